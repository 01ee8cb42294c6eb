"""The runner's side of images: ``ImageEncoder`` runs the vision tower for the images a step needs (once per image,
every image of the step in one call per shape) and caches their embeddings on their requests until their tokens are
computed; it builds the step's token inputs (``inputs_embeds``: text embeddings with the image rows written in; for
Qwen3-VL, whose vision tower also feeds rows to its first decoder layers (DeepStack), and Gemma 4, the token ids with
the step's image rows as the model's ``mm_encoder_outputs``), Qwen2-VL's ``[3, T]`` M-RoPE position ids, and Gemma 3's
and Gemma 4's widened image queries. The request's side (``RequestImages``) is ``multimodal.py``.
"""

from __future__ import annotations

import torch

from ..metadata import PadQueries
from .multimodal import (DEEPSTACK_FAMILIES, ENCODER_OUTPUT_FAMILIES, SLIDING_BIDIRECTIONAL_FAMILIES, TILED_FAMILIES,
                         RequestImages, image_token_id)


class ImageEncoder:
    """The runner's side: runs the vision tower (``model.get_image_features``) for the images a step needs and
    builds the step's token inputs. ``num_encoded_images``: images encoded so far (tiles for a tiled family)."""

    def __init__(self, model) -> None:
        self.model = model
        self.embed_tokens = model.get_input_embeddings()
        self.num_encoded_images = 0
        self.deepstack = model.config.model_type in DEEPSTACK_FAMILIES
        self.encoder_outputs = model.config.model_type in ENCODER_OUTPUT_FAMILIES
        # the layer groups an image's two-way attention applies to: the sliding ones (Gemma 4), else every group
        self.sliding_bidirectional = model.config.model_type in SLIDING_BIDIRECTIONAL_FAMILIES
        self.token = image_token_id(model)
        self.tiled = model.config.model_type in TILED_FAMILIES
        self.encoder_output = None  # the class of a DeepStack tower's outputs (pooler_output, deepstack_features)

    def step_inputs(self, scheduled, input_ids: torch.Tensor, query_start_loc: torch.Tensor) -> dict | None:
        """The model's token keywords for the packed step (``input_ids`` ``[T]``, sequence ``i``'s rows from
        ``query_start_loc[i]``) when some scheduled token is an image's, else None: ``inputs_embeds`` ``[1, T,
        hidden]`` with the image rows written in, or, for a DeepStack model and Gemma 4 (``encoder_outputs``),
        ``input_ids`` ``[1, T]`` and ``mm_encoder_outputs`` holding the step's image rows in row order (the model
        writes them at its image tokens; a DeepStack model adds each DeepStack layer's rows after that decoder
        layer)."""
        needed = []  # (row of the step, images, image index, first token, last token + 1)
        for i, item in enumerate(scheduled):
            images = item.seq.request.images
            if images is None:
                continue
            stop = item.start + item.num_tokens
            for index in images.overlapping(item.start, stop):
                needed.append((i, images, index, item.start, stop))
        if not needed:
            return None
        self._encode([(images, index) for _, images, index, _, _ in needed if index not in images.embeds])
        starts = query_start_loc.tolist()
        pieces = []  # (first row, image index's rows first .. last - 1 of its embeddings, images, index)
        for i, images, index, start, stop in needed:
            span = images.spans[index]
            first, last = max(start, span.offset), min(stop, span.end)
            pieces.append((starts[i] + first - start, first - span.offset, last - span.offset, images, index))
        device = self.embed_tokens.weight.device
        if self.encoder_outputs:
            return self._encoder_output_inputs(pieces, input_ids.to(device))
        embeds = self.embed_tokens(input_ids.to(device))
        for row, a, b, images, index in pieces:
            embeds[row : row + b - a] = images.embeds[index][a:b]
        return dict(inputs_embeds=embeds.unsqueeze(0))

    def _encoder_output_inputs(self, pieces: list, input_ids: torch.Tensor) -> dict:
        """The keywords of a step of an ``ENCODER_OUTPUT_FAMILIES`` model (``input_ids`` ``[T]``): the model writes
        ``mm_encoder_outputs``' rows, in row order, at every token equal to its image token, so a token of that id
        outside the step's image spans (a generated one) gets a row too: its own embedding (and zero DeepStack rows,
        which leave it text)."""
        rows = [(row, images.embeds[index][a:b], [layer[a:b] for layer in images.deepstack.get(index, ())])
                for row, a, b, images, index in pieces]
        spans = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, embeds, _ in rows:
            spans[row : row + embeds.shape[0]] = True
        stray = ((input_ids == self.token) & ~spans).nonzero().flatten().tolist()
        if stray:
            text = self.embed_tokens(input_ids[stray[:1]])
            rows += [(row, text, [layer.new_zeros(1, layer.shape[-1]) for layer in rows[0][2]]) for row in stray]
        rows.sort(key=lambda piece: piece[0])
        image = torch.cat([embeds for _, embeds, _ in rows])
        if not self.deepstack:
            return dict(input_ids=input_ids.unsqueeze(0),
                        mm_encoder_outputs={"image": self.encoder_output(pooler_output=(image,))})
        layers = [torch.cat([deepstack[layer] for _, _, deepstack in rows]) for layer in range(len(rows[0][2]))]
        outputs = self.encoder_output(pooler_output=(image,), deepstack_features=[(layer,) for layer in layers])
        return dict(input_ids=input_ids.unsqueeze(0), mm_encoder_outputs={"image": outputs})

    def _encode(self, missing: list[tuple[RequestImages, int]]) -> None:
        """Runs the vision tower once over the ``missing`` images (grouped by shape; an image that several of them
        hold, by its pixels' digest, once: the others share its embeddings), caching each one's embeddings on its
        request; ``ValueError`` when an image's embeddings do not match its placeholders."""
        groups: dict[tuple, list[tuple[RequestImages, int]]] = {}
        encoded: dict[str, tuple[RequestImages, int]] = {}  # by digest: the image the tower runs on
        copies = []  # (an image, the encoded one of the same digest)
        for images, index in missing:
            span = images.spans[index]
            if span.digest in encoded:
                copies.append(((images, index), encoded[span.digest]))
                continue
            encoded[span.digest] = (images, index)
            groups.setdefault(tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(span.tensors.items())),
                              []).append((images, index))
        self._run_tower(groups)
        for (images, index), (source, source_index) in copies:
            length = source.spans[source_index].length
            if images.spans[index].length != length:
                raise ValueError(f"image {index} gives {length} embeddings but the prompt holds "
                                 f"{images.spans[index].length} placeholder tokens for it")
            images.embeds[index] = source.embeds[source_index]
            if self.deepstack:
                images.deepstack[index] = source.deepstack[source_index]

    def _run_tower(self, groups: dict[tuple, list[tuple[RequestImages, int]]]) -> None:
        """``_encode``'s vision tower: one call per group of images of one shape."""
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        for members in groups.values():
            batch = {name: torch.cat([images.spans[index].tensors[name] for images, index in members]).to(device)
                     for name in members[0][0].spans[members[0][1]].tensors}
            batch["pixel_values"] = batch["pixel_values"].to(dtype)
            if self.tiled:  # ``[tiles, 1, ...]``: one output per batch row, so one per tile
                batch = {name: value.unsqueeze(1) for name, value in batch.items()}
            encoded = self.model.get_image_features(**batch)
            self.encoder_output = type(encoded)  # the model's forward takes it back as ``mm_encoder_outputs``
            for member, ((images, index), feature) in enumerate(zip(members, encoded.pooler_output)):
                span = images.spans[index]
                feature = feature.reshape(-1, feature.shape[-1])
                if feature.shape[0] != span.length:
                    raise ValueError(f"image {index} gives {feature.shape[0]} embeddings but the prompt holds "
                                     f"{span.length} placeholder tokens for it (the processor expands them: use "
                                     f"the model's processor)")
                images.embeds[index] = feature.to(dtype)
                if self.deepstack:  # [layer][image] -> this image's rows of each DeepStack layer
                    images.deepstack[index] = [layer[member].to(dtype) for layer in encoded.deepstack_features]
            self.num_encoded_images += len(members)

    @staticmethod
    def positions(scheduled, positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor | None:
        """``[3, T]`` M-RoPE position ids of the packed step (``positions`` ``[T]``: each token's position), or None
        when no scheduled request has M-RoPE positions (the model reads ``positions`` as they are)."""
        if not any(item.seq.request.images is not None and item.seq.request.images.mrope_positions is not None
                   for item in scheduled):
            return None
        out = positions.unsqueeze(0).repeat(3, 1)
        starts = query_start_loc.tolist()
        for i, item in enumerate(scheduled):
            images = item.seq.request.images
            if images is None or images.mrope_positions is None:
                continue
            stop = item.start + item.num_tokens
            prompt_len = images.mrope_positions.shape[1]
            row = starts[i]
            if item.start < prompt_len:
                count = min(stop, prompt_len) - item.start
                out[:, row : row + count] = images.mrope_positions[:, item.start : item.start + count]
            first = max(item.start, prompt_len)
            if stop > first:  # generated tokens: their position plus the delta, in every row
                at = row + first - item.start
                out[:, at : at + stop - first] += images.rope_delta
        return out

    def bidirectional_queries(self, scheduled, metadata) -> PadQueries | None:
        """The step's queries inside a bidirectional image (Gemma 3; Gemma 4 in its sliding layer groups), each
        attending keys up to its image's last token (this step holds it: ``ImageChunks``) from its own window start;
        None when there are none."""
        rows, seqs, bounds = [], [], []
        starts = metadata.query_start_loc.tolist()
        for i, item in enumerate(scheduled):
            images = item.seq.request.images
            if images is None or not images.bidirectional:
                continue
            stop = item.start + item.num_tokens
            for index in images.overlapping(item.start, stop):
                span = images.spans[index]
                first = max(item.start, span.offset)
                rows.extend(range(starts[i] + first - item.start, starts[i] + span.end - item.start))
                seqs.extend([i] * (span.end - first))
                bounds.extend([span.end - 1] * (span.end - first))
        if not rows:
            return None
        device = metadata.positions.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        own = metadata.positions.index_select(0, index).long()
        window_starts = [None if group.window is None else (own - group.window + 1).clamp_min(0)
                         for group in metadata.groups]
        groups = tuple(group.window is not None for group in metadata.groups) if self.sliding_bidirectional else None
        return PadQueries(index, torch.tensor(seqs, dtype=torch.long, device=device),
                          torch.tensor(bounds, dtype=torch.long, device=device), window_starts, groups)

    @staticmethod
    def release(scheduled) -> None:
        """After a step's forward: drops the embeddings of the images whose last token it computed."""
        for item in scheduled:
            images = item.seq.request.images
            if images is not None and images.embeds:
                stop = item.start + item.num_tokens
                for index in [i for i in images.embeds if images.spans[i].end <= stop]:
                    del images.embeds[index]
                    images.deepstack.pop(index, None)

"""``KVFormat``: how one ``kv_cache_dtype`` lays out K and V in the pools, in one place.

``quant.py`` builds its storages from it, the kernels take their constexprs from it (``kernel_meta``), the warm-up
and compile report build example operands from it, and the benchmarks count bytes with it. A format says:

- the stored codes: their dtype (``None``: the compute dtype, no codes) and how many values one code holds
  (int4: two per byte);
- its side data: a scale (and, for asymmetric formats, a zero point) per *token* per KV head (``[num_blocks,
  block_size, num_kv_heads]``) or per *channel* of a block per KV head (``[num_blocks, num_kv_heads, head_dim]``,
  over the block's tokens), separately for keys and values; always float16;
- its tail policy: ``tail=True`` keeps each sequence's newest, not yet full block in the compute dtype (a "tail"
  pool of one block per sequence row, outside the block pool) and quantizes the block once, when it fills;
- which of K and V are stored rotated (``rotation.py``).

Formats (bytes per token and KV head at head_dim ``D``, block size ``B``; float16 K+V is ``4 D``):

=========== ============ ============================== ============================== ===== ================
name        codes        key side data                  value side data                tail  rotation
=========== ============ ============================== ============================== ===== ================
auto        model dtype  none                           none                           no    none
int8        int8         scale per token                scale per token                no    K and V
fp8_e4m3    float8 e4m3  scale per token                scale per token                no    K and V
fp8_e5m2    float8 e5m2  scale per token                scale per token                no    K and V
int4        uint8 (x2)   scale + zero per channel/block scale + zero per token         yes   V only
=========== ============ ============================== ============================== ===== ================

int4 bytes per token per KV head: ``D + 4 + 4 D / B`` (codes, value scale + zero, the key scales + zeros of a block
shared by its ``B`` tokens): at D = 64, 3.05x fewer than float16 at B = 16, 3.37x at 32, 3.56x at 64, 3.66x at 128.
The per-channel side data is paid once per block, so the block size is int4's granularity knob: ``block_size=64``
is the setting that reaches 3.5x (``benchmarks/kv_quality.py`` reports both, and the bytes held with the tail at
128, 768 and 4096 tokens). Its keys are quantized per channel over the block (keys have outlier channels: KIVI,
KVQuant) and not rotated (a rotation mixes those channels: measured worse); its values per token after the rotation
(measured better). See ``benchmarks/RESULTS.md`` for the measurements behind these choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIDE_DTYPE = torch.float16  # every scale and zero point
_FP8 = {"fp8_e4m3": getattr(torch, "float8_e4m3fn", None), "fp8_e5m2": getattr(torch, "float8_e5m2", None)}
# Kernel constexprs. CODES: how a code decodes; SIDE: granularity of a scale.
CODES_MODEL, CODES_INT8, CODES_E4M3, CODES_E5M2, CODES_INT4 = 0, 1, 2, 3, 4
SIDE_NONE, SIDE_TOKEN, SIDE_CHANNEL = 0, 1, 2
_SIDE_IDS = {"none": SIDE_NONE, "token": SIDE_TOKEN, "channel": SIDE_CHANNEL}


@dataclass(frozen=True)
class KVFormat:
    """The storage layout of one ``kv_cache_dtype`` (see the module docstring)."""

    name: str
    codes: int  # CODES_* constant
    code_dtype_name: str | None  # torch dtype name of the codes; None: the compute dtype
    values_per_code: int
    key_side: str  # "none" | "token" | "channel"
    value_side: str  # "none" | "token"
    zero_points: bool  # asymmetric: a zero point beside every scale
    tail: bool  # newest partial block kept in the compute dtype, quantized when full
    rotate_keys: bool
    rotate_values: bool

    @property
    def quantized(self) -> bool:
        return self.code_dtype_name is not None

    def code_dtype(self) -> torch.dtype:
        """Torch dtype of the codes; ValueError for fp8 on a torch without float8 dtypes."""
        if self.name in _FP8:
            if _FP8[self.name] is None:
                raise ValueError(f"kv_format={self.name!r} needs torch float8 dtypes, which torch "
                                 f"{torch.__version__} lacks")
            return _FP8[self.name]
        if self.code_dtype_name is None:
            raise ValueError(f"kv_format={self.name!r} stores the compute dtype, not codes")
        return getattr(torch, self.code_dtype_name)

    def code_dim(self, head_dim: int) -> int:
        """Last dimension of the code pools."""
        if head_dim % self.values_per_code:
            raise ValueError(f"kv_cache_dtype={self.name!r} packs {self.values_per_code} values per byte: head_dim "
                             f"must be a multiple of {self.values_per_code}, got {head_dim=}")
        return head_dim // self.values_per_code

    def side_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> dict:
        """``{pool name: shape}`` of the side data (float16), in the kernels' argument order: key scale, value
        scale, key zero, value zero; formats without some of them leave them out."""
        shapes = {}
        for which, side in (("key", self.key_side), ("value", self.value_side)):
            if side == "token":
                shapes[f"{which}_scale"] = (num_blocks, block_size, num_kv_heads)
            elif side == "channel":
                shapes[f"{which}_scale"] = (num_blocks, num_kv_heads, head_dim)
        if self.zero_points:
            shapes.update({name.replace("scale", "zero"): shape for name, shape in list(shapes.items())})
        return shapes

    def bytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block of one layer: codes (or the compute dtype) plus every scale and zero point. The tail
        pool is not counted here (``tail_bytes_per_row``)."""
        if not self.quantized:
            return 2 * block_size * num_kv_heads * head_dim * _itemsize(dtype)
        codes = 2 * block_size * num_kv_heads * self.code_dim(head_dim) * _itemsize(self.code_dtype())
        side = sum(_numel(s) for s in self.side_shapes(1, block_size, num_kv_heads, head_dim).values())
        return codes + side * _itemsize(SIDE_DTYPE)

    def tail_bytes_per_row(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one sequence row of the tail pools (K and V of one block in the compute dtype); 0 without."""
        return 2 * block_size * num_kv_heads * head_dim * _itemsize(dtype) if self.tail else 0

    def kernel_meta(self) -> dict:
        """The constexprs the attention and store kernels specialize on."""
        return dict(CODES=self.codes, KEY_SIDE=_SIDE_IDS[self.key_side], VALUE_SIDE=_SIDE_IDS[self.value_side],
                    ZERO=self.zero_points, TAIL=self.tail)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


KV_FORMATS = {
    fmt.name: fmt
    for fmt in (
        KVFormat("auto", CODES_MODEL, None, 1, "none", "none", False, False, False, False),
        KVFormat("int8", CODES_INT8, "int8", 1, "token", "token", False, False, True, True),
        KVFormat("fp8_e4m3", CODES_E4M3, "float8_e4m3fn", 1, "token", "token", False, False, True, True),
        KVFormat("fp8_e5m2", CODES_E5M2, "float8_e5m2", 1, "token", "token", False, False, True, True),
        KVFormat("int4", CODES_INT4, "uint8", 2, "channel", "token", True, True, False, True),
    )
}
QUANTIZED_KV_FORMATS = tuple(name for name, fmt in KV_FORMATS.items() if fmt.quantized)


def kv_format(name: str) -> KVFormat:
    """The ``KVFormat`` of a canonical format name; ValueError for any other name."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"kv_format={name!r} is not one of {tuple(KV_FORMATS)}") from None

"""``KVFormat``: how one ``kv_cache_dtype`` lays out K and V in the pools, in one place.

``quant.py`` builds its storages from it, the kernels take their constexprs from it (``kernel_meta``), the warm-up
and compile report build example operands from it, and the benchmarks count bytes with it. A format says:

- the stored codes: their dtype (``None``: the compute dtype, no codes) and how many values one code holds
  (int4: two per byte);
- its side data (``side_shapes``: the shape and dtype of each side pool), separately for keys and values:
  ``"token"``: a float16 scale per token per KV head (``[num_blocks, block_size, num_kv_heads]``);
  ``"channel"`` (int4 keys): a range per channel of a block per KV head, as 8-bit codes on a float16 grid of the
  (block, head); ``"token_code"`` (int4 values): a 4-bit scale code per token on a float16 maximum of the
  (block, head);
- its tail policy: ``tail=True`` keeps each sequence's newest, not yet full block in the compute dtype (a "tail"
  pool of one block per sequence row, outside the block pool) and quantizes the block once, when it fills; the
  paged attention then reads each query's own block in full precision (the tail row and the forward's new K/V) and
  only the blocks before it quantized, so a prefill chunk sees what a decode step sees (``attention_ref``);
- which of K and V are stored rotated (``rotation.py``).

Formats (bytes per token and KV head at head_dim ``D``, block size ``B``; float16 K+V is ``4 D``):

=========== ============ ============================== ============================== ===== ================
name        codes        key side data                  value side data                tail  rotation
=========== ============ ============================== ============================== ===== ================
auto        model dtype  none                           none                           no    none
int8        int8         scale per token                scale per token                no    K and V
fp8_e4m3    float8 e4m3  scale per token                scale per token                no    K and V
fp8_e5m2    float8 e5m2  scale per token                scale per token                no    K and V
int4        uint8 (x2)   range per channel/block        scale code per token           yes   V only
=========== ============ ============================== ============================== ===== ================

The four side operands keep their names and order everywhere (``key_scale, value_scale, key_zero, value_zero``;
``nb`` blocks, ``H`` KV heads); what they hold:

- int8, fp8: ``key_scale``, ``value_scale`` float16 ``[nb, B, H]`` (a scale per token); no zeros.
- int4: ``key_scale`` uint8 ``[nb, H, 2, D]``: each key channel's range codes ``u_lo`` (index 0) and ``u_hi`` (1);
  ``key_zero`` float16 ``[nb, H, 2]``: the grid of the (block, head), ``base`` (0) and ``step`` (1);
  ``value_scale`` uint8 ``[nb, H, B // 2]``: each token's scale code ``k`` in ``[0, 15]``, two per byte, token
  ``2i`` in the low nibble; ``value_zero`` float16 ``[nb, H]``: ``vmax`` of the (block, head).

int4 (``kv_quant`` has the math): a key channel ``c`` of a block covers ``[lo_c, hi_c]``, ``lo_c = base + step *
u_lo``, ``hi_c = base + step * u_hi``, and decodes ``x = lo_c + q (hi_c - lo_c) / 15``; a value token decodes
``x = (q - 8) s``, ``s = vmax * 2^(-k / 3)``. The kernels need the int4 side pools contiguous over a block (as
allocated): the range codes of ``(block, head)`` start at ``head_dim`` times the grid's element offset, the scale
codes at ``block_size // 2`` times ``vmax``'s (``_common.check_pools`` checks it), so three strides per side reach
them (``PoolOperands.side_strides``). int4 needs an even ``block_size``.

int4 bytes per block per KV head: ``B D`` of codes, ``2 D + 4`` of key ranges and grid, ``B / 2 + 2`` of value
scale codes and maximum, i.e. ``B D + 2 D + B / 2 + 6``: 1166 at D = 64, B = 16, 3.51x fewer than float16 (3.53x
at D = 128; 3.73x at B = 32, D = 64). Its keys are quantized per channel over the block (keys have outlier
channels: KIVI, KVQuant) and not rotated (a rotation mixes those channels: measured worse); its values per token
after the rotation (measured better). The side data are 8-bit ranges on a per-(block, head) grid and 4-bit
log-scale codes chosen by least squared error, instead of float16 scales and zeros per channel and per token
(3.05x): measured with the own-block reads, KL to the float16 model 7.1e-3 against 5.9e-3 with the float16 side
data, and each in the table of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIDE_DTYPE = torch.float16  # the float side data (scales, zero points, int4's grid and vmax)
_FP8 = {"fp8_e4m3": getattr(torch, "float8_e4m3fn", None), "fp8_e5m2": getattr(torch, "float8_e5m2", None)}
# Kernel constexprs. CODES: how a code decodes; SIDE: granularity of a scale.
CODES_MODEL, CODES_INT8, CODES_E4M3, CODES_E5M2, CODES_INT4 = 0, 1, 2, 3, 4
SIDE_NONE, SIDE_TOKEN, SIDE_CHANNEL, SIDE_TOKEN_CODE = 0, 1, 2, 3
_SIDE_IDS = {"none": SIDE_NONE, "token": SIDE_TOKEN, "channel": SIDE_CHANNEL, "token_code": SIDE_TOKEN_CODE}


@dataclass(frozen=True)
class KVFormat:
    """The storage layout of one ``kv_cache_dtype`` (see the module docstring)."""

    name: str
    codes: int  # CODES_* constant
    code_dtype_name: str | None  # torch dtype name of the codes; None: the compute dtype
    values_per_code: int
    key_side: str  # "none" | "token" | "channel"
    value_side: str  # "none" | "token" | "token_code"
    zero_points: bool  # key_zero / value_zero pools exist (int4: the key grid and the value maximum)
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

    def check_shared_values(self) -> None:
        """ValueError unless keys and values are stored alike (side data, rotation, no tail), as they must be for a
        layer whose one row serves as both (multi-head latent attention: ``KVStorage(shared_values=True)``)."""
        if self.key_side != self.value_side or self.rotate_keys != self.rotate_values or self.tail:
            raise ValueError(
                f"kv_cache_dtype={self.name!r} quantizes keys and values differently (keys per channel over a "
                f"block, values per token), but a multi-head latent attention layer stores one row a token that "
                f"serves as both its key and its value: use kv_cache_dtype 'auto', 'int8', 'fp8' or 'fp8_e5m2'")

    def check_block_size(self, block_size: int) -> None:
        """ValueError when this format cannot lay out blocks of ``block_size`` tokens (int4: odd sizes)."""
        if self.value_side == "token_code" and block_size % 2:
            raise ValueError(f"block_size must be even for kv_cache_dtype={self.name!r} (two value scale codes per "
                             f"byte along a block's tokens), got block_size={block_size}")

    def side_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> dict:
        """``{pool name: (shape, dtype)}`` of the side data, in the kernels' argument order: key scale, value scale,
        key zero, value zero; formats without some of them leave them out (see the module docstring for what each
        holds). ValueError for a ``block_size`` the format cannot lay out."""
        self.check_block_size(block_size)
        pools = {}
        if self.key_side == "token":
            pools["key_scale"] = ((num_blocks, block_size, num_kv_heads), SIDE_DTYPE)
        elif self.key_side == "channel":  # range codes u_lo, u_hi per channel
            pools["key_scale"] = ((num_blocks, num_kv_heads, 2, head_dim), torch.uint8)
        if self.value_side == "token":
            pools["value_scale"] = ((num_blocks, block_size, num_kv_heads), SIDE_DTYPE)
        elif self.value_side == "token_code":  # 4-bit scale codes, two tokens per byte
            pools["value_scale"] = ((num_blocks, num_kv_heads, block_size // 2), torch.uint8)
        if self.zero_points:
            if self.key_side == "channel":  # the grid: base, step
                pools["key_zero"] = ((num_blocks, num_kv_heads, 2), SIDE_DTYPE)
            if self.value_side == "token_code":  # vmax
                pools["value_zero"] = ((num_blocks, num_kv_heads), SIDE_DTYPE)
        return pools

    def bytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        shared_values: bool = False) -> int:
        """Bytes of one block of one layer: codes (or the compute dtype) plus all the side data. The tail pool is not
        counted here (``tail_bytes_per_row``). ``shared_values``: the keys' pools alone (``check_shared_values``: a
        format that stores keys and values alike, so half of both)."""
        if shared_values:
            self.check_shared_values()
            return self.bytes_per_block(block_size, num_kv_heads, head_dim, dtype) // 2
        if not self.quantized:
            return 2 * block_size * num_kv_heads * head_dim * _itemsize(dtype)
        codes = 2 * block_size * num_kv_heads * self.code_dim(head_dim) * _itemsize(self.code_dtype())
        side = self.side_shapes(1, block_size, num_kv_heads, head_dim).values()
        return codes + sum(_numel(shape) * _itemsize(side_dtype) for shape, side_dtype in side)

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
        KVFormat("int4", CODES_INT4, "uint8", 2, "channel", "token_code", True, True, False, True),
    )
}
QUANTIZED_KV_FORMATS = tuple(name for name, fmt in KV_FORMATS.items() if fmt.quantized)


def kv_format(name: str) -> KVFormat:
    """The ``KVFormat`` of a canonical format name; ValueError for any other name."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"kv_format={name!r} is not one of {tuple(KV_FORMATS)}") from None

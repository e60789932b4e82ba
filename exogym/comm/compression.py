"""Compressors: what a node sends instead of a float tensor, and how the receiver gets a tensor back.

`payload = c.encode(x)` gives the tensors that would cross the network (`payload.tensors`; the
shape and dtype of x travel with it but are not sent: every node compresses tensors of the same
shapes); `c.decode(payload)` gives a tensor shaped and typed like x. `c.nbytes(shape)` is the
formula for the bytes sent, payload plus scales. Codecs know nothing of nodes; how their payloads
cross nodes (one all-gather, decoded and averaged in rank order) is exogym.strategy.compressed_reduce.

- IntQuantizer(bits=8 or 4, block_size=None): symmetric uniform ints, one float32 scale per row
  (x viewed as [numel / last dim, last dim]; a vector is one row) or per block of block_size
  consecutive entries; int4 codes are packed two per byte. Error |x - x^| <= scale / 2.
- FP8Quantizer / FP4Quantizer(block_size=None): scaled minifloats e4m3 (torch.float8_e4m3fn's
  grid) and e2m1 (packed two per byte); the largest |x| of a row or block maps to the format's max.
- TopK(fraction, values=None): the largest-magnitude entries: int32 indices + values (or the
  values compressed by another compressor).
- ErrorFeedback(compressor): what was not sent (x - decode(encode(x))) is added to the next x
  encoded under the same key, so over many steps what is sent sums to what was meant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Hashable, Sequence

import torch

from exogym._validation import check_int, check_number

__all__ = ["Payload", "Compressor", "Quantizer", "IntQuantizer", "FP8Quantizer", "FP4Quantizer", "TopK",
           "ErrorFeedback", "compressor_from", "minifloat_grid", "round_to_minifloat"]

_SCALE = torch.float32  # scales are sent as float32 (4 bytes each), so the error bounds hold exactly


@dataclass(frozen=True)
class Payload:
    """What a compressor sends for one tensor.

    Args:
        tensors: What is sent.
        shape: The shape of the tensor it encodes (known to every node, not sent).
        dtype: The dtype of the tensor it encodes (known to every node, not sent).
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """The bytes sent: those of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> "Payload":
        """The same layout carrying other tensors (another node's, after they crossed the network).

        Args:
            tensors: The other tensors, in the same order and shapes.

        Returns:
            The new Payload.
        """
        return replace(self, tensors=tuple(tensors))


class Compressor:
    """The compressor interface: `encode(x, key)` -> Payload; `decode(payload)` -> a tensor like x; `nbytes(shape)`.

    `key` names the stream x belongs to (e.g. a parameter); only stateful compressors use it.
    """

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Payload:
        """Compress `x` into what is sent.

        Args:
            x: The tensor.
            key: The stream x belongs to (e.g. a parameter); only stateful compressors use it.

        Returns:
            The Payload.
        """
        raise NotImplementedError

    def decode(self, payload: Payload) -> torch.Tensor:
        """The tensor a payload stands for.

        Args:
            payload: What `encode` returned (this node's or another's).

        Returns:
            A tensor of the payload's shape and dtype.
        """
        raise NotImplementedError

    def nbytes(self, shape: Sequence[int]) -> int:
        """The bytes sent for a tensor of this shape.

        Args:
            shape: The tensor's shape.

        Returns:
            The bytes.
        """
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The compressor's memory across calls (tensors and plain data); stateless ones have none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (`{}` empties the memory).

        Args:
            state: What `state_dict()` returned.
        """

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({knobs})"


class Quantizer(Compressor):
    """A dense compressor: every entry is sent, each at fewer bits, with one scale per row or block.

    Args:
        block_size: One scale per block of this many entries (the tensor flattened); None: one per row (the last
            dimension).

    Raises:
        ValueError: `block_size` < 1.
    """

    def __init__(self, block_size: int | None = None):
        check_int("block_size", block_size, minimum=1, allow_none=True)
        self.block_size = block_size

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as float32 [rows, width]: its own rows, or blocks of block_size (zero-padded at the end)."""
        flat = x.detach().reshape(-1).to(_SCALE)
        if self.block_size is None:
            width = x.shape[-1] if x.dim() >= 1 and x.shape[-1] > 0 else 1
            return flat.reshape(-1, width)
        pad = -flat.numel() % self.block_size
        return torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, self.block_size)

    def num_scales(self, shape: Sequence[int]) -> int:
        """How many scales a tensor of this shape is sent with (one per row or block).

        Args:
            shape: The tensor's shape.

        Returns:
            The number of scales.
        """
        n = math.prod(shape)
        if self.block_size is not None:
            return math.ceil(n / self.block_size)
        return n // shape[-1] if len(shape) >= 1 and shape[-1] > 0 else n

    def _scales(self, rows: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale per row so that the row's largest |x| maps to `top`, rows divided by it)."""
        scale = rows.abs().amax(dim=1) / top if rows.numel() else rows.new_zeros(rows.shape[0])  # [rows]
        return scale, rows / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]

    def _restore(self, values: torch.Tensor, scale: torch.Tensor, payload: Payload) -> torch.Tensor:
        """values [n] in scaled units -> the tensor, each row or block times its scale."""
        n, rows = math.prod(payload.shape), scale.numel()
        width = self.block_size or (n // rows if rows else 1)
        padded = torch.cat([values, values.new_zeros(rows * width - values.numel())]).reshape(rows, width)
        return (padded * scale[:, None]).reshape(-1)[:n].reshape(payload.shape).to(payload.dtype)


class IntQuantizer(Quantizer):
    """Symmetric uniform quantization to `bits`-bit ints: q = round(x / s), s = max|row| / (2^(bits-1) - 1).

    Bytes for a tensor of n entries in R rows or blocks: n (int8) or ceil(n / 2) (int4) + 4 R.

    Args:
        bits: 8 or 4.
        block_size: One scale per block of this many entries (the tensor flattened); None: one per row (the last
            dimension).

    Raises:
        ValueError: `bits` is neither 8 nor 4, or `block_size` < 1.
    """

    def __init__(self, bits: int = 8, *, block_size: int | None = None):
        if bits not in (8, 4):
            raise ValueError(f"IntQuantizer bits must be 8 or 4, got {bits!r}; for 4-bit floats use FP4Quantizer()")
        super().__init__(block_size)
        self.bits = bits

    @property
    def qmax(self) -> int:
        """The largest code: 127 (int8) or 7 (int4); codes are symmetric, -qmax..qmax."""
        return 2 ** (self.bits - 1) - 1  # 127 or 7: symmetric, so -qmax..qmax

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Payload:
        scale, scaled = self._scales(self._rows(x), self.qmax)
        q = scaled.round().clamp(-self.qmax, self.qmax).reshape(-1)[:x.numel()].to(torch.int8)  # [n]
        codes = q if self.bits == 8 else _pack_nibbles((q + 8).to(torch.uint8))  # int4: 1..15 in a nibble
        return Payload((codes, scale), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        codes, scale = payload.tensors
        n = math.prod(payload.shape)
        q = codes if self.bits == 8 else _unpack_nibbles(codes, n).to(torch.int8) - 8
        return self._restore(q.to(_SCALE), scale, payload)

    def nbytes(self, shape: Sequence[int]) -> int:
        n = math.prod(shape)
        return (n if self.bits == 8 else (n + 1) // 2) + 4 * self.num_scales(shape)


def minifloat_grid(exponent_bits: int, mantissa_bits: int, *, nan_code: bool) -> torch.Tensor:
    """The non-negative values of an IEEE-style minifloat, indexed by their code (increasing in the code).

    Bias 2^(e-1) - 1, subnormals, no infinities.

    Args:
        exponent_bits: e, the exponent's bits.
        mantissa_bits: The mantissa's bits.
        nan_code: True drops the all-ones code (NaN in e4m3fn).

    Returns:
        The values, a float32 tensor.
    """
    bias = 2 ** (exponent_bits - 1) - 1
    codes = torch.arange(2 ** (exponent_bits + mantissa_bits), dtype=torch.float64)
    exp, man = torch.div(codes, 2 ** mantissa_bits, rounding_mode="floor"), codes % 2 ** mantissa_bits
    frac = man / 2 ** mantissa_bits
    values = torch.where(exp == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (exp - bias))
    return (values[:-1] if nan_code else values).to(_SCALE)


def round_to_minifloat(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Codes of float32 `y` rounded to the nearest grid value (sign bit on top of the magnitude's index in `grid`).

    Ties go to the even code (IEEE round-to-nearest-even); beyond the largest value, saturating.

    Args:
        y: The float32 values.
        grid: The magnitudes, as `minifloat_grid` returns them.

    Returns:
        The codes, a uint8 tensor shaped like `y`.
    """
    mag = y.abs().clamp(max=grid[-1])
    mid = (grid[:-1] + grid[1:]) / 2
    idx = torch.bucketize(mag, mid)  # ties go down: mag == mid[i] gives i
    tie = (idx < mid.numel()) & (mag == mid[idx.clamp(max=mid.numel() - 1)]) & (idx % 2 == 1)
    idx = idx + tie.long()  # an odd code on a tie moves up to the even one
    sign_bit = 1 << (grid.numel() - 1).bit_length()
    return (idx + sign_bit * torch.signbit(y).long()).to(torch.uint8)


class _MinifloatQuantizer(Quantizer):
    exponent_bits: int
    mantissa_bits: int
    nan_code: bool

    def __init__(self, *, block_size: int | None = None):
        super().__init__(block_size)
        self._grid = minifloat_grid(self.exponent_bits, self.mantissa_bits, nan_code=self.nan_code)

    @property
    def packed(self) -> bool:
        """Whether codes are 4 bits, sent two per byte."""
        return self.exponent_bits + self.mantissa_bits + 1 == 4

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        return round_to_minifloat(y, self._grid.to(y.device))

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Payload:
        scale, scaled = self._scales(self._rows(x), float(self._grid[-1]))
        codes = self._codes(scaled.reshape(-1)[:x.numel()])  # [n] uint8
        return Payload((_pack_nibbles(codes) if self.packed else codes, scale), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        codes, scale = payload.tensors
        n = math.prod(payload.shape)
        codes = (_unpack_nibbles(codes, n) if self.packed else codes).long()
        sign_bit = 1 << (self._grid.numel() - 1).bit_length()
        grid = self._grid.to(codes.device)
        values = grid[codes % sign_bit] * torch.where(codes >= sign_bit, -1.0, 1.0)
        return self._restore(values, scale, payload)

    def nbytes(self, shape: Sequence[int]) -> int:
        n = math.prod(shape)
        return ((n + 1) // 2 if self.packed else n) + 4 * self.num_scales(shape)


class FP8Quantizer(_MinifloatQuantizer):
    """Scaled fp8 e4m3 (`torch.float8_e4m3fn`: max 448, 3 mantissa bits).

    Relative error <= 2^-4 above 2^-6 s, absolute <= 2^-10 s below, s = max|row| / 448. Bytes: n + 4 R. Uses
    torch's float8 cast when this torch has it, else rounds to the same grid itself (bit-identical codes).

    Args:
        block_size: One scale per block of this many entries (the tensor flattened); None: one per row (the last
            dimension).
    """

    exponent_bits, mantissa_bits, nan_code = 4, 3, True

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        if hasattr(torch, "float8_e4m3fn"):
            return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return super()._codes(y)


class FP4Quantizer(_MinifloatQuantizer):
    """Scaled fp4 e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), packed two per byte.

    Error <= |x| / 4, and <= s / 4 near zero, s = max|row| / 6. Bytes: ceil(n / 2) + 4 R.

    Args:
        block_size: One scale per block of this many entries (the tensor flattened); None: one per row (the last
            dimension).
    """

    exponent_bits, mantissa_bits, nan_code = 2, 1, False


class TopK(Compressor):
    """The max(1, round(fraction n)) largest-magnitude entries of x, with their indices; zero elsewhere.

    Their int32 indices (int64 past 2^31 entries) and values, the values as they are or compressed by
    `values`. Bytes: k (4 + value bytes), or k 4 + `values.nbytes([k])`. The decoded tensor is zero elsewhere.

    Args:
        fraction: The fraction of the entries sent, in (0, 1].
        values: A Quantizer for the values, or None to send them as they are.

    Raises:
        ValueError: `fraction` outside (0, 1].
        TypeError: `values` is not a Quantizer.
    """

    def __init__(self, fraction: float, *, values: Quantizer | None = None):
        check_number("fraction", fraction, positive=True, maximum=1.0)
        if values is not None and not isinstance(values, Quantizer):
            raise TypeError(f"TopK values= must be a Quantizer (IntQuantizer, FP8Quantizer, FP4Quantizer) or None, "
                            f"got {values!r}")
        self.fraction, self.values = fraction, values

    def k(self, n: int) -> int:
        """How many entries of a tensor of n entries are sent: max(1, round(fraction n)), at most n.

        Args:
            n: The tensor's number of entries.

        Returns:
            k.
        """
        return min(n, max(1, round(self.fraction * n)))

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Payload:
        flat = x.detach().reshape(-1)
        idx = flat.abs().topk(self.k(flat.numel()), sorted=False).indices.sort().values  # [k], ascending
        picked = flat[idx]
        idx = idx.to(torch.int32 if flat.numel() < 2 ** 31 else torch.int64)
        inner = (picked,) if self.values is None else self.values.encode(picked).tensors
        return Payload((idx, *inner), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        idx, *inner = payload.tensors
        if self.values is None:
            picked = inner[0]
        else:
            picked = self.values.decode(Payload(tuple(inner), torch.Size([idx.numel()]), payload.dtype))
        out = torch.zeros(math.prod(payload.shape), dtype=payload.dtype, device=idx.device)
        return out.index_copy_(0, idx.long(), picked.to(payload.dtype)).reshape(payload.shape)

    def nbytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        n = math.prod(shape)
        k = self.k(n)
        index = 4 if n < 2 ** 31 else 8
        value = k * torch.empty((), dtype=dtype).element_size() if self.values is None else self.values.nbytes([k])
        return k * index + value


class ErrorFeedback(Compressor):
    """Wraps a compressor so that what it loses in one step is sent in later ones.

    For each key, x + residual is encoded and residual <- (x + residual) - decoded (Seide et al. 2014;
    Karimireddy et al. 2019). `key=None` encodes without memory. Bytes: those of the wrapped compressor.

    Args:
        compressor: The Compressor to wrap (not itself an ErrorFeedback).

    Raises:
        TypeError: `compressor` is not a Compressor, or is an ErrorFeedback.
    """

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor) or isinstance(compressor, ErrorFeedback):
            raise TypeError(f"ErrorFeedback wraps a compressor (IntQuantizer, FP8Quantizer, FP4Quantizer, TopK), "
                            f"got {compressor!r}")
        self.compressor = compressor
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Payload:
        if key is None:
            return self.compressor.encode(x)
        residual = self.residuals.get(key)
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"ErrorFeedback key {key!r} was used for shape {tuple(residual.shape)} and now for "
                             f"{tuple(x.shape)}; give each stream of same-shaped tensors its own key")
        meant = x.detach() + residual if residual is not None else x.detach().clone()
        payload = self.compressor.encode(meant)
        self.residuals[key] = meant - self.compressor.decode(payload)
        return payload

    def decode(self, payload: Payload) -> torch.Tensor:
        return self.compressor.decode(payload)

    def nbytes(self, shape: Sequence[int]) -> int:
        return self.compressor.nbytes(shape)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals)} if self.residuals else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = dict(state.get("residuals", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"


def compressor_from(quantization_bits: int | None, compression: Compressor | None) -> Compressor | None:
    """A communication module's compressor from either spelling.

    Args:
        quantization_bits: 8 or 4: an IntQuantizer with per-row scales.
        compression: Any Compressor.

    Returns:
        The compressor, or None for neither.

    Raises:
        TypeError: Both are given, or `compression` is not a Compressor.
        ValueError: `quantization_bits` is neither 8 nor 4.
    """
    if quantization_bits is not None and compression is not None:
        raise TypeError(f"got both quantization_bits={quantization_bits!r} and compression={compression!r}; pass "
                        f"one (compression=IntQuantizer({quantization_bits}) is the same as quantization_bits)")
    if quantization_bits is not None:
        if quantization_bits not in (8, 4) or isinstance(quantization_bits, bool):
            raise ValueError(f"quantization_bits must be 8 or 4 (ints with per-row scales), got "
                             f"{quantization_bits!r}; for fp8 / fp4 pass compression=FP8Quantizer() / FP4Quantizer()")
        return IntQuantizer(quantization_bits)
    if compression is not None and not isinstance(compression, Compressor):
        raise TypeError(f"compression must be an exogym.comm.compression Compressor (IntQuantizer, FP8Quantizer, "
                        f"FP4Quantizer, TopK, ErrorFeedback), got {compression!r}")
    return compression


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [n] -> [ceil(n / 2)] bytes: entry 2i in the low nibble, 2i + 1 in the high one."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]

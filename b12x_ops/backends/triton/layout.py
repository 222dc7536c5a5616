"""The code layout the Triton backend keeps its MXFP4 weights in (made once, at prepare).

A checkpoint stores a weight matrix as ``[E, R, KH]`` bytes: row ``r``'s byte ``h`` holds elements
``2h`` (low nibble) and ``2h + 1``. The kernels decode the codes in registers in the layout of the
tensor-core MMA's first operand, so ``prepare`` rewrites the bytes once (the repacked tensor
replaces the checkpoint's; it is no larger, but for K padded to a multiple of 64) such that:

* **a thread's operand bytes are contiguous.** Rows come in groups of 16 (one MMA row tile) and
  row bytes in chunks of 32 (64 elements). A (group, chunk) is 512 bytes, 16 for each of a warp's
  32 lanes, so a K step loads 16 contiguous bytes a lane a chunk, and the loaded
  ``[groups, chunks, 32, 16]`` tile is the ``[rows, bytes]`` operand tile after a reshape and a
  permute that move no data (``mxtl.repacked_to_operand``). Lane ``l`` holds rows ``r0 = l // 4``
  and ``r0 + 8`` of its group; its byte ``b = 8 s + 4 kh + 2 rh + kk`` of a chunk is the code byte
  of row ``r0 + 8 rh`` at row byte ``16 s + 8 kh + 2 (l % 4) + kk`` of the chunk: the element
  order of the MMA operand's registers.
* **a 32-bit word decodes in 13 instructions for 8 weights.** A word's 4 bytes (``rh``, ``kk``)
  hold 8 nibbles, whose bits are re-laid so that each bf16 pair comes out with the sign at bit 15
  of each half and ``e1 e0 m`` at bits 8..6 (the E2M1 value times 2^-126 as a bf16) in few
  integer instructions: pair 0 is ``w & 0x81C081C0``, pair 1 ``(w << 6) & 0x81C081C0``, pair 2
  the word rotated right by 4 and masked, pair 3 two pieces (its ``m`` bits shifted left by 2, the
  rest rotated right by 6): 9 integer instructions and 4 multiplies by the scales
  (``mxtl._decode_repacked_ptx_source``). A rotation moves some of a low half's fields to the high
  half's bits and back, so a pair's fields are given as bit positions in the word for its low
  half's weight; its high half's are 16 further, modulo 32. Pair ``p = 2 odd + rh`` holds the even
  (low) or odd (high) nibbles of rows ``r0 + 8 rh``, its low half from byte ``kk = 0``, its high
  half from ``kk = 1``.

``repack_codes`` makes the layout (in chunks of experts, so a large layer's temporaries stay
small); ``unpack_codes`` is its inverse (tests). OpenAI's triton_kernels uses the same two ideas
for its Hopper weight layout.
"""

from __future__ import annotations

import torch

# Where each nibble bit lands: per pair p (0..3), the word bit that receives the (sign, e1, e0, m)
# of its low half's weight; its high half's weight's are 16 further, modulo 32 (``_bit``). Every
# bit of the word is used once.
PAIR_BITS = (
    (15, 8, 7, 6),  # pair 0: w & mask
    (9, 2, 1, 0),  # pair 1: (w << 6) & mask
    (19, 12, 11, 10),  # pair 2: rotr(w, 4) & mask (the low weight's sign in the high half, and back)
    (21, 14, 13, 4),  # pair 3: (w << 2) & m bits | rotr(w, 6) & sign, e1, e0 bits
)
GROUP_ROWS = 16
CHUNK_BYTES = 32
# temporaries of the repack: about this many code bytes at a time
_CHUNK = 1 << 24


def _bit(low: int, kk: int) -> int:
    """The word bit of a field at ``low`` for the low half's weight (``kk`` 0) or the high half's (1)."""
    return (low + 16 * kk) % 32


def chunks(kh: int) -> int:
    """Row-byte chunks of 32 a row of ``kh`` code bytes takes (the last one zero-padded)."""
    return -(-kh // CHUNK_BYTES)


def repacked_shape(codes_shape) -> tuple[int, ...]:
    E, R, KH = codes_shape
    return (E, R // GROUP_ROWS, chunks(KH), 32, 16)


def _byte_tables(device) -> torch.Tensor:
    """``[2 rh, 2 kk, 256]`` int32: the bits a code byte of row half ``rh`` and byte ``kk`` of its
    word contributes to the word (its low nibble to pair ``rh``, its high one to pair ``2 + rh``)."""
    t = torch.zeros(2, 2, 256, dtype=torch.int64)
    byte = torch.arange(256)
    for rh in range(2):
        for kk in range(2):
            for odd in range(2):
                nib = (byte >> (4 * odd)) & 15
                for bit, dst in zip((3, 2, 1, 0), PAIR_BITS[2 * odd + rh]):
                    t[rh, kk] |= ((nib >> bit) & 1) << _bit(dst, kk)
    t = torch.where(t >= 1 << 31, t - (1 << 32), t)  # as int32 bit patterns
    return t.to(torch.int32).to(device)


def repack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[E, R, KH]`` MXFP4 code bytes (``R`` a multiple of 16) in the layout above:
    ``[E, R / 16, ceil(KH / 32), 32, 16]`` uint8 (row bytes past ``KH`` are zero codes)."""
    E, R, KH = codes.shape
    if R % GROUP_ROWS:
        raise ValueError(f"repack_codes: rows must be a multiple of {GROUP_ROWS}, got {R}")
    G, Q = R // GROUP_ROWS, chunks(KH)
    tables = _byte_tables(codes.device)
    out = torch.empty(repacked_shape(codes.shape), dtype=torch.uint8, device=codes.device)
    step = max(1, _CHUNK // max(1, R * Q * CHUNK_BYTES))
    for e0 in range(0, E, step):
        c = codes[e0:e0 + step]
        n = c.shape[0]
        if Q * CHUNK_BYTES != KH:
            c = torch.nn.functional.pad(c, (0, Q * CHUNK_BYTES - KH))
        c = c.to(torch.int64).view(n, G, 2, 8, Q, 2, 2, 4, 2)  # e, g, rh, r0, q, s, kh, c, kk
        word = torch.zeros(n, G, 8, Q, 2, 2, 4, dtype=torch.int32, device=codes.device)
        for rh in range(2):
            for kk in range(2):
                word |= tables[rh, kk][c[:, :, rh, :, :, :, :, :, kk]]
        # -> [e, g, q, r0, c, s, kh]: lane (r0, c), its words (s, kh); little-endian bytes
        out[e0:e0 + n] = word.permute(0, 1, 3, 2, 6, 4, 5).contiguous().view(torch.uint8).view(n, G, Q, 32, 16)
    return out


def unpack_codes(packed: torch.Tensor, kh: int) -> torch.Tensor:
    """The inverse of ``repack_codes``: ``[E, R, kh]`` code bytes."""
    E, G, Q = packed.shape[:3]
    word = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [e, g, q, 32, 4]
    word = word.view(E, G, Q, 8, 4, 2, 2).permute(0, 1, 3, 2, 5, 6, 4)  # e, g, r0, q, s, kh, c
    out = torch.zeros(E, G, 2, 8, Q, 2, 2, 4, 2, dtype=torch.int64, device=packed.device)
    for rh in range(2):
        for kk in range(2):
            for odd in range(2):
                for bit, src in zip((3, 2, 1, 0), PAIR_BITS[2 * odd + rh]):
                    out[:, :, rh, :, :, :, :, :, kk] |= ((word >> _bit(src, kk)) & 1) << (bit + 4 * odd)
    return out.view(E, G * 16, Q * CHUNK_BYTES)[:, :, :kh].to(torch.uint8)

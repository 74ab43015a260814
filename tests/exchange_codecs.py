"""Small test codecs shaped like farloco.optim's (structural TensorCodec): fp32, blockwise int8, top-k sparse.

Test-only helpers: the exchange must work with any codec of this shape, so its tests do not depend on optim.
"""

from __future__ import annotations

import struct

import numpy as np
import torch


class Fp32Codec:
    name = "fp32"
    dense = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        return tensor.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        if len(data) % 4:
            raise ValueError(f"fp32 payload must be a multiple of 4 bytes, got {len(data)}")
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


class Int8Codec:
    """Blockwise absmax int8: u32 numel | fp32 scale per block | int8 values. Error <= scale/2 per value."""

    name = "int8"
    dense = True

    def __init__(self, block: int = 4096) -> None:
        self.block = block

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1).contiguous()
        numel = flat.numel()
        pad = (-numel) % self.block
        padded = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block)
        scales = padded.abs().amax(dim=1) / 127.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(padded / scales[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
        return struct.pack("<I", numel) + scales.numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        (numel,) = struct.unpack_from("<I", data, 0)
        num_blocks = -(-numel // self.block)
        if len(data) != 4 + 4 * num_blocks + numel:
            raise ValueError(f"int8 payload of {len(data)} bytes does not match numel={numel}")
        scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=num_blocks, offset=4).copy())
        q = torch.from_numpy(np.frombuffer(data, dtype=np.int8, count=numel, offset=4 + 4 * num_blocks).copy())
        pad = (-numel) % self.block
        values = torch.nn.functional.pad(q.to(torch.float32), (0, pad)).view(-1, self.block) * scales[:, None]
        return values.reshape(-1)[:numel].contiguous()


class TopKCodec:
    """Sparse: u32 numel | u32 k | int64 indices | fp32 values of the k largest magnitudes."""

    name = "topk"
    dense = False

    def __init__(self, fraction: float = 0.1) -> None:
        self.fraction = fraction

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1)
        k = max(1, int(flat.numel() * self.fraction)) if flat.numel() else 0
        indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values if k else torch.empty(0, dtype=torch.int64)
        values = flat[indices]
        return struct.pack("<II", flat.numel(), k) + indices.numpy().astype("<i8").tobytes() + values.numpy().astype("<f4").tobytes()

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        numel, k = struct.unpack_from("<II", data, 0)
        if len(data) != 8 + 12 * k:
            raise ValueError(f"topk payload of {len(data)} bytes does not match k={k}")
        indices = torch.from_numpy(np.frombuffer(data, dtype="<i8", count=k, offset=8).copy())
        values = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=k, offset=8 + 8 * k).copy())
        if k and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ValueError("topk index out of range")
        out = torch.zeros(numel, dtype=torch.float32)
        out[indices] = values
        return out

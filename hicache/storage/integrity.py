"""Per-page integrity for L3 objects: a length and a CRC-32 travel with every stored page.

A backend stores either a sealed object (``seal``: a 24-byte header, then the payload) or,
where it writes pages zero-copy from the host pool, the payload plus a separate small
``PageDigest`` object. On read, ``unseal`` / ``PageDigest.verify`` reject a page that came back
short, long or changed; the caller serves it as a cache miss.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

MAGIC = b"SHKV"
VERSION = 1
_HEADER = struct.Struct("<4sIQI4x")  # magic, version, payload length, crc32, pad to 24 bytes
HEADER_BYTES = _HEADER.size

Buffer = Union[bytes, bytearray, memoryview, torch.Tensor, np.ndarray]


class CorruptPage(ValueError):
    """A stored page failed its length or checksum check."""


def _bytes_view(buf: Buffer) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("page buffers must be contiguous CPU tensors")
        buf = buf.view(torch.uint8).reshape(-1).numpy()
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    return memoryview(buf).cast("B")


def checksum(buf: Buffer) -> int:
    """CRC-32 of the buffer's bytes."""
    return zlib.crc32(_bytes_view(buf)) & 0xFFFFFFFF


@dataclass(frozen=True)
class PageDigest:
    """Length and CRC-32 of one page, stored beside a zero-copy page object."""

    length: int
    crc32: int

    @classmethod
    def of(cls, buf: Buffer) -> "PageDigest":
        return cls(len(_bytes_view(buf)), checksum(buf))

    def to_bytes(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.length, self.crc32)

    @classmethod
    def from_bytes(cls, raw: Buffer) -> "PageDigest":
        mv = _bytes_view(raw)
        if len(mv) < HEADER_BYTES:
            raise CorruptPage(f"digest is {len(mv)} bytes, expected {HEADER_BYTES}")
        magic, version, length, crc = _HEADER.unpack_from(mv)
        if magic != MAGIC or version != VERSION:
            raise CorruptPage(f"bad digest header (magic={magic!r}, version={version})")
        return cls(length, crc)

    def verify(self, buf: Buffer) -> None:
        """Raise CorruptPage unless ``buf`` has this length and checksum."""
        mv = _bytes_view(buf)
        if len(mv) != self.length:
            raise CorruptPage(f"page is {len(mv)} bytes, expected {self.length}")
        crc = checksum(mv)
        if crc != self.crc32:
            raise CorruptPage(f"page checksum {crc:#010x} != stored {self.crc32:#010x}")


def seal(payload: Buffer) -> bytes:
    """Header (length, CRC-32) followed by the payload: one self-checking object."""
    mv = _bytes_view(payload)
    return PageDigest.of(mv).to_bytes() + mv.tobytes()


def unseal(obj: Buffer) -> memoryview:
    """The payload of a sealed object (a view into ``obj``); CorruptPage when the object is
    short, long, or its payload's checksum differs."""
    mv = _bytes_view(obj)
    digest = PageDigest.from_bytes(mv[:HEADER_BYTES])
    payload = mv[HEADER_BYTES:]
    digest.verify(payload)
    return payload

"""Decodes protobuf's wire format by hand, without the generated classes.

Enough for the messages t5export reads without TensorFlow: a tensor
bundle's header and index entries and a checkpoint's object graph
(docs/internals.md lists the fields each uses). `server_replay` keeps a
decoder of its own: it runs as a file, without t5export.
"""

from __future__ import annotations

from collections.abc import Iterator


def varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
  """(The varint at `pos`, the position after it)."""
  result = shift = 0
  while True:
    if pos >= len(buf) or shift > 63:
      raise ValueError('truncated or overlong varint')
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7f) << shift
    if byte < 0x80:
      return result, pos
    shift += 7


def fields(buf: bytes | memoryview) -> Iterator[tuple[int, int | bytes]]:
  """(field number, int or bytes value) of each field of a protobuf."""
  pos, end = 0, len(buf)
  while pos < end:
    tag, pos = varint(buf, pos)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      value, pos = varint(buf, pos)
    elif wire in (1, 5):
      width = 8 if wire == 1 else 4
      value = int.from_bytes(buf[pos:pos + width], 'little')
      pos += width
    elif wire == 2:
      size, pos = varint(buf, pos)
      value = bytes(buf[pos:pos + size])
      pos += size
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    if pos > end:
      raise ValueError('truncated protobuf field')
    yield number, value

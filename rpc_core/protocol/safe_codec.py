"""``RpcBackendOptions(serializer="safe")``: the codec ``serialization`` uses instead of pickle.

Bodies and frame heads are in rpc_core's own encoding (``safe_encoding``, ``safe_decoding``);
tensors keep their out-of-band buffers, exactly as under pickle (``serialization.packed``,
``rebuild_tensors``). ``use(serializer)`` installs the process's codec at ``init_rpc``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import errors
from . import allowlist, safe_decoding, safe_encoding, serialization, wire
from .safe_decoding import decode
from .safe_encoding import encode
from .serialization import Serialized, TensorMeta

SERIALIZERS = ("pickle", "safe")  # options.SERIALIZERS


class SafeCodec:
    name = "safe"

    def serialize(self, obj: Any) -> Serialized:
        body, tensors, sparse = encode(obj)
        return serialization.packed(body, tensors, sparse)

    def encode_head(self, metas: Sequence[TensorMeta], extras: dict[str, Any] | None) -> bytes:
        return safe_encoding.encode_head(metas, extras)

    def decode_head(self, head: bytes) -> tuple[Sequence[TensorMeta], dict[str, Any] | None]:
        return safe_decoding.decode_head(head)

    def loads(self, body: Any, tensors: Sequence[torch.Tensor]) -> Any:
        return decode(body, tensors)


_SAFE = SafeCodec()


def use(serializer: str) -> None:
    """Make this process's messages use ``serializer`` ("pickle" or "safe")."""
    if serializer not in SERIALIZERS:
        raise ValueError(f"serializer must be one of {SERIALIZERS}, got {serializer!r}")
    serialization.use_codec(_SAFE if serializer == "safe" else None)


# What rpc_core's own messages hold, beyond plain values: a remote error's record, the
# exceptions rpc_core raises, tensors' classes (an RRef's value type).
allowlist.internal(
    wire.ExceptionInfo,
    torch.Tensor,
    torch.nn.Parameter,
    *(obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, BaseException)),
)

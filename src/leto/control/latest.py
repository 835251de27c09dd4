"""A store value that is replaced, never deleted, read with one round trip once it exists."""

from __future__ import annotations

import torch.distributed as dist


class Latest:
    """The latest value of `key` (None until first set): a check until it exists, then a get."""

    def __init__(self, store: dist.Store, key: str) -> None:
        self.store, self.key, self._exists = store, key, False

    def read(self) -> bytes | None:
        if not self._exists:
            if not self.store.check([self.key]):
                return None
            self._exists = True
        return self.store.get(self.key)

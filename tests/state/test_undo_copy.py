"""FlatState.undo_copy / rollback: tensors of every kind get their contents back."""
from __future__ import annotations

import pytest
import torch

from raydcp.state import UndoCopy, flatten_state


@pytest.mark.parametrize("pack", [UndoCopy.PACK_BYTES, 48], ids=["one-buffer", "several-buffers"])
def test_undo_copy_restores_dense_strided_empty_and_odd_dtypes(monkeypatch, pack):
    monkeypatch.setattr(UndoCopy, "PACK_BYTES", pack)
    base = torch.arange(24.0).reshape(4, 6)
    sd = {
        "dense": torch.arange(10, dtype=torch.int64),
        "bf16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "strided": base[:, ::2],  # a view: its base is not in the state dict
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }
    before = {k: v.detach().clone() for k, v in sd.items()}
    flat = flatten_state(sd, for_load=True)
    copies = flat.undo_copy(list(flat.tensors))
    assert isinstance(copies, UndoCopy)
    assert copies.nbytes == sum(v.nbytes for v in before.values())
    # packed in flattening order: 80 bytes alone (over 48), then 14 + 3 + 4 + 16 (the view is copied apart)
    assert len(copies._bufs) == (1 if pack > 1000 else 2)
    with torch.no_grad():
        for v in sd.values():
            v.zero_() if v.dtype != torch.bool else v.fill_(True)
    flat.rollback(copies)
    for k, v in sd.items():
        assert torch.equal(v.detach(), before[k]), k
    assert torch.equal(base[:, 1::2], torch.arange(24.0).reshape(4, 6)[:, 1::2])  # the rest untouched

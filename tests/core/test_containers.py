"""The one container walker (``core._containers.map_items``): containers keep their own types."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from autoddp.core import _containers


class Output(OrderedDict):
    """Like HF's ``ModelOutput``: fields by name in the constructor, ``update()`` refused, items
    mirrored as attributes."""

    def __init__(self, logits=None, loss=None):
        super().__init__()
        for key, value in (("logits", logits), ("loss", loss)):
            if value is not None:
                self[key] = value

    def update(self, *args, **kwargs):
        raise RuntimeError("update() is not allowed")

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


@pytest.mark.unit
def test_a_dict_type_with_fields_of_its_own_and_no_update_is_copied_item_by_item():
    out = Output(logits=1, loss=2)
    mapped = _containers.map_items(out, lambda v: v * 10)
    assert type(mapped) is Output and dict(mapped) == {"logits": 10, "loss": 20}
    assert mapped.logits == 10 and out.logits == 1  # (the original left as it was)
    assert _containers.map_items(out, lambda v: v) is out  # nothing changed: itself

import pytest

from kvserve.kvcache import FullAttentionSpec
from kvserve.kvcache.specs import SlidingWindowSpec
from kvserve.model.memory.layer_groups import group_layers

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype_bytes=4)
SLIDE = SlidingWindowSpec(
    block_size=16, sliding_window=64, num_kv_heads=2, head_size=8, dtype_bytes=4
)


def test_full_attention_only_is_one_group():
    layout = group_layers([FULL] * 4)
    assert len(layout.specs) == 1 and layout.specs[0].num_layers == 4
    assert layout.layer_group == [0, 0, 0, 0] and layout.layer_slot == [0, 1, 2, 3]
    assert layout.page_bytes == 4 * FULL.page_bytes


def test_gemma3_pattern_splits_windows_into_groups_of_the_full_size():
    # 5 local layers, then 1 global, twice: 10 sliding + 2 full -> groups of 2 layers.
    layers = ([SLIDE] * 5 + [FULL]) * 2
    layout = group_layers(layers)
    kinds = [spec.kind for spec in layout.specs]
    assert kinds == ["sliding_window"] * 5 + ["full_attention"]
    assert all(spec.num_layers == 2 for spec in layout.specs)
    # Every group's page has the same bytes: one pool serves them all.
    assert len({spec.page_bytes for spec in layout.specs}) == 1
    assert layout.layer_group[5] == layout.layer_group[11] == 5
    assert layout.layer_slot[5] == 0 and layout.layer_slot[11] == 1
    assert sorted(zip(layout.layer_group, layout.layer_slot, strict=True)) == sorted(
        {(g, s) for g, s in zip(layout.layer_group, layout.layer_slot, strict=True)}
    )


def test_no_layers_is_an_error():
    with pytest.raises(ValueError):
        group_layers([])

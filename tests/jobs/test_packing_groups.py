"""Packing with groups (lm-eval's choices of one context): a group's texts are
taken one after another, so they share a pass where it holds them; every pass
still holds rows x its longest text within the capacity."""

from deltafin_mlx.jobs.score_packing import pack


def test_a_groups_texts_share_a_pass_and_passes_stay_within_capacity():
    # three questions of four choices; lengths interleave across questions
    lengths = [10, 12, 11, 13, 12, 10, 13, 11, 11, 13, 10, 12]
    groups = [i // 4 for i in range(12)]
    capacity = lambda longest: 4 * 13  # noqa: E731
    by_length = pack(lengths, capacity)
    assert any(len({groups[i] for i in p}) > 1 for p in by_length)  # without groups: mixed
    passes = pack(lengths, capacity, groups)
    assert sorted(i for p in passes for i in p) == list(range(12))
    assert [sorted(groups[i] for i in p) for p in passes] == [[g] * 4 for g in (0, 1, 2)]
    for p in passes:
        assert len(p) * max(lengths[i] for i in p) <= capacity(None)


def test_a_longer_text_later_in_a_pass_widens_it():
    lengths = [4, 9, 9]  # group 0 is [4], group 1 is [9, 9]: taken 9, 9, then 4
    passes = pack(lengths, lambda longest: 20, groups=[0, 1, 1])
    assert passes == [[1, 2], [0]]
    passes = pack([9, 4, 9], lambda longest: 20, groups=[0, 0, 1])
    for p in passes:
        assert len(p) * max([9, 4, 9][i] for i in p) <= 20

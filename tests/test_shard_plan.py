"""The shard split (``pytest_dflash.session.shard``): the form of K/N, determinism, whole timing
gates, balance by recorded cost and by count."""

from __future__ import annotations

import pytest

from pytest_dflash.session import shard

# the real node ids' shape: a timing gate's tests share route and kind, parity tests do not
SPEED = [(f"suites/test_speed_attn.py::test_speed[r.a.fast-T{t}]", "r.a.fast", "speed")
         for t in (128, 256, 512)]
VC = [(f"suites/test_vc.py::test_vc[r.a.fast-M{m}]", "r.a.fast", "validation_cost")
      for m in range(1, 5)]
PARITY = [(f"suites/test_parity.py::test_parity[r.a.fast-case{i}]", "r.a.fast", "parity")
          for i in range(10)]
OTHER = [("tests/test_plain.py::test_x", None, None)]
ALL = SPEED + VC + PARITY + OTHER


@pytest.mark.parametrize("text", ["", "3", "1/", "/3", "a/b", "1-3", "1/3/4", "1.5/3", "-1/3"])
def test_a_malformed_shard_names_the_form(text: str) -> None:
    with pytest.raises(shard.ShardError, match=r"not of the form K/N .*--dflash-shard 2/3"):
        shard.parse(text)


@pytest.mark.parametrize("text", ["0/3", "4/3", "1/0", "0/0"])
def test_an_out_of_range_shard_names_the_form(text: str) -> None:
    with pytest.raises(shard.ShardError, match=r"K must lie in 1\.\.N.*K/N with whole numbers"):
        shard.parse(text)


def test_a_good_shard_parses() -> None:
    assert shard.parse(" 2 / 3 ") == shard.Shard(2, 3)
    assert str(shard.parse("1/1")) == "1/1"


def test_every_test_lands_in_exactly_one_shard_and_timing_gates_stay_whole() -> None:
    where = shard.plan(ALL, {}, 3)
    assert sorted(where) == sorted(n for n, _, _ in ALL)
    assert set(where.values()) == {1, 2, 3}
    assert len({where[n] for n, _, _ in SPEED}) == 1
    assert len({where[n] for n, _, _ in VC}) == 1
    assert len({where[n] for n, _, _ in PARITY}) > 1  # other gates are split test by test


def test_the_split_is_the_same_whatever_the_order_of_the_items() -> None:
    first = shard.plan(ALL, {}, 4)
    assert shard.plan(list(reversed(ALL)), {}, 4) == first
    # every shard of one plan records the same digest; another selection gives another
    digest = shard.record(shard.Shard(1, 4), ALL, first, shard.COUNT)["plan_sha256"]
    assert shard.record(shard.Shard(3, 4), ALL, first, shard.COUNT)["plan_sha256"] == digest
    fewer = shard.plan(ALL[1:], {}, 4)
    assert shard.record(shard.Shard(1, 4), ALL[1:], fewer, shard.COUNT)["plan_sha256"] != digest


def test_by_count_the_shares_differ_by_at_most_one_unit_of_tests() -> None:
    where = shard.plan(PARITY + OTHER, {}, 3)
    sizes = sorted(list(where.values()).count(k) for k in (1, 2, 3))
    assert sizes == [3, 4, 4]


def test_recorded_costs_balance_the_shares() -> None:
    """One 100 s timing gate against many 1 s tests: by count it would share a shard with half
    of them; by cost it gets a shard of its own and the rest share the other."""
    costs = {n: 100.0 / len(SPEED) for n, _, _ in SPEED}
    costs.update({n: 1.0 for n, _, _ in PARITY})
    where = shard.plan(SPEED + PARITY, costs, 2)
    speed_shard = where[SPEED[0][0]]
    assert all(where[n] != speed_shard for n, _, _ in PARITY)
    by_count = shard.plan(SPEED + PARITY, {}, 2)
    assert any(by_count[n] == by_count[SPEED[0][0]] for n, _, _ in PARITY)


def test_an_unrecorded_test_costs_the_mean_of_the_recorded_ones() -> None:
    units = shard.units(PARITY[:3], {PARITY[0][0]: 2.0, PARITY[1][0]: 4.0})
    assert [u.cost for u in units] == [2.0, 4.0, 3.0]
    assert [u.cost for u in shard.units(PARITY[:2], {})] == [1.0, 1.0]


def test_more_shards_than_units_leave_some_empty() -> None:
    where = shard.plan(SPEED, {}, 3)
    record = shard.record(shard.Shard(3, 3), SPEED, where, shard.COUNT)
    assert record["assigned"] == 0 and record["selected"] == 3
    assert "shard 3/3 got no test of the 3 selected" in shard.empty_note(record)


def test_costs_come_from_a_reports_durations(tmp_path) -> None:
    from reportmaker import make

    path = make(tmp_path / "r.json")
    costs, source = shard.load_costs(str(path), tmp_path)
    assert costs == {"t.py::test_parity[toy.add.fast]": 0.1, "t.py::test_speed[toy.add.fast]":
                     0.1, "t.py::test_parity[toy.add.slow]": 0.1}
    assert source.startswith("r.json (")
    assert shard.load_costs(None, tmp_path) == ({}, shard.COUNT)  # no kept run: by count
    with pytest.raises(shard.ShardError, match="--dflash-shard-costs: .*neither a report file"):
        shard.load_costs("nothing-here", tmp_path)

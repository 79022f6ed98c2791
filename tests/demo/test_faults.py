"""The demo's failure draw: weights from the Llama 3 table, stratified times, replay."""

from __future__ import annotations

from collections import Counter

import pytest

from demo import faults


def catalog():
    return faults.load_catalog()


def test_table_is_the_llama3_mix():
    rows = catalog()
    assert sum(r.interruptions for r in rows) == 419  # the paper's unexpected interruptions
    by = {r.component: r for r in rows}
    assert by["Faulty GPU"].interruptions == 148
    assert by["Silent Data Corruption"].failure_class == "rollback"
    assert {r.failure_class for r in rows} == set(faults.FAILURE_CLASSES)


@pytest.mark.parametrize(
    ("seconds", "mtbf", "n"), [(180, 60, 3), (60, 60, 1), (59, 60, 0), (300, 45, 6)]
)
def test_a_run_of_a_given_length_gets_seconds_over_mtbf_failures(seconds, mtbf, n):
    for seed in range(20):
        got = list(
            faults.schedule(
                catalog(),
                seconds=seconds,
                mtbf_s=mtbf,
                seed=seed,
                world_size=4,
                warmup_s=15,
                tail_s=25,
            )
        )
        assert len(got) == n


def test_each_failure_lands_in_its_own_slot_after_warmup_and_before_the_tail():
    for seed in range(50):
        got = list(
            faults.schedule(
                catalog(), seconds=180, mtbf_s=60, seed=seed, world_size=4, warmup_s=15, tail_s=25
            )
        )
        slot = (180 - 25 - 15) / 3
        for f in got:
            assert 15 + slot * f.index <= f.at_s < 15 + slot * (f.index + 1)
            assert 0 <= f.rank < 4
        assert [f.at_s for f in got] == sorted(f.at_s for f in got)


def test_same_seed_replays_and_another_seed_differs():
    def run(seed):
        return [
            (f.at_s, f.kind.component, f.rank)
            for f in faults.schedule(
                catalog(), seconds=600, mtbf_s=60, seed=seed, world_size=4, warmup_s=15, tail_s=25
            )
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_draw_follows_the_interruption_counts():
    counts = Counter()
    for seed in range(200):
        for f in faults.schedule(
            catalog(), seconds=1500, mtbf_s=60, seed=seed, world_size=4, warmup_s=0, tail_s=0
        ):
            counts[f.kind.component] += 1
    total = sum(counts.values())
    share = counts["Faulty GPU"] / total
    assert abs(share - 148 / 419) < 0.03  # 5,000 draws: ± 3 points is > 4 standard errors
    assert counts["Silent Data Corruption"] > 0


def test_endless_schedule_for_a_run_until_ctrl_c():
    it = faults.schedule(
        catalog(), seconds=0, mtbf_s=30, seed=1, world_size=4, warmup_s=10, tail_s=25
    )
    first = [next(it) for _ in range(5)]
    for f in first:
        assert 10 + 30 * f.index <= f.at_s < 10 + 30 * (f.index + 1)


@pytest.mark.parametrize(
    ("component", "category", "klass", "action", "fault"),
    [
        ("Faulty GPU", "GPU", "node", "gpu", "xid"),
        ("GPU HBM3 Memory", "GPU", "node", "gpu", "ecc-dbe"),
        ("GPU Thermal Interface + Sensor", "GPU", "node", "gpu", "temp"),
        ("Some new GPU part", "GPU", "node", "gpu", "xid"),
        ("Host Maintenance", "Unplanned Maintenance", "node", "host", None),
        ("NIC", "Host", "node", "host", None),
        ("Software Bug", "Dependency", "process", "process", None),
        ("NCCL Watchdog Timeouts", "Unknown", "process", "process", None),
        ("Network Switch/Cable", "Network", "rack", "network", None),
        ("Silent Data Corruption", "GPU", "rollback", "sdc", None),
    ],
)
def test_every_kind_of_failure_is_made_real_by_its_effect(
    component, category, klass, action, fault
):
    e = faults.effect_of(faults.FailureKind(component, category, 1, klass))
    assert (e.action, e.fault) == (action, fault)
    assert e.describe()


# Each row of app/data/llama3_interruptions.csv and the effect the demo gives it.
ROW_EFFECTS = {
    "Faulty GPU": ("gpu", "xid", 79, "XID 79 + rank killed"),
    "GPU HBM3 Memory": ("gpu", "ecc-dbe", None, "uncorrectable ECC error (XID 48) + rank killed"),
    "Software Bug": ("process", None, None, "rank killed"),
    "Network Switch/Cable": (
        "network",
        None,
        None,
        "rank killed + the node's peer replicas dropped",
    ),
    "Host Maintenance": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "GPU SRAM Memory": ("gpu", "xid", 95, "XID 95 + rank killed"),
    "GPU System Processor": ("gpu", "xid", 119, "XID 119 + rank killed"),
    "NIC": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "NCCL Watchdog Timeouts": ("process", None, None, "rank killed"),
    "Silent Data Corruption": ("sdc", None, None, "a weight corrupted in the running job"),
    "GPU Thermal Interface + Sensor": ("gpu", "temp", 97, "GPU at 97 °C + rank killed"),
    "SSD": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "Power Supply": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "Server Chassis": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "IO Expansion Board": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "Dependency": ("process", None, None, "rank killed"),
    "CPU": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
    "System Memory": ("host", None, None, "agent killed + memory tier wiped + rank killed"),
}


def test_every_row_of_the_table_has_an_effect():
    rows = catalog()
    assert [r.component for r in rows] == list(ROW_EFFECTS)
    for row in rows:
        e = faults.effect_of(row)
        assert (e.action, e.fault, e.value, e.describe()) == ROW_EFFECTS[row.component], row


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("component,category,percent,failure_class\nA,GPU,1,node\n", "missing column(s) interrupt"),
        (
            "component,category,interruptions,percent,failure_class\nA,GPU,x,1,node\n",
            "line 2: interruptions must be a whole number",
        ),
        (
            "component,category,interruptions,percent,failure_class\nA,GPU,-3,1,node\n",
            "line 2: interruptions must be a whole number",
        ),
        (
            "component,category,interruptions,percent,failure_class\nA,GPU,3,1,cosmic\n",
            "failure_class 'cosmic' is not one of",
        ),
        (
            "component,category,interruptions,percent,failure_class\nA,GPU,0,1,node\n",
            "no row has any interruptions",
        ),
    ],
)
def test_bad_table_is_refused_with_what_to_fix(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(faults.CatalogError, match=message.replace("(", r"\(").replace(")", r"\)")):
        faults.load_catalog(path)


def test_missing_table_names_the_file(tmp_path):
    with pytest.raises(faults.CatalogError, match="cannot read the interruption table"):
        faults.load_catalog(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mtbf_s": 0}, "DEMO_MTBF must be > 0"),
        ({"seconds": -1}, "DEMO_SECONDS must be ≥ 0"),
        ({"world_size": 0}, "world_size must be ≥ 1"),
        ({"seconds": 40, "mtbf_s": 20}, "leaves no time"),
    ],
)
def test_bad_run_parameters_are_refused(kw, message):
    args = {
        "seconds": 180,
        "mtbf_s": 60,
        "seed": 1,
        "world_size": 4,
        "warmup_s": 15,
        "tail_s": 25,
        **kw,
    }
    with pytest.raises(ValueError, match=message):
        list(faults.schedule(catalog(), **args))

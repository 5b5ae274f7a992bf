"""The --inject grammar: good specs parse, bad ones fail with a message that names the problem."""

import pytest

from trainer.faults import Fault, FaultInjector, FaultSpecError, parse_fault


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("slow:delay=0.5", Fault("slow", "slow:delay=0.5", delay=0.5)),
        ("slow:delay=2,from_step=10", Fault("slow", "slow:delay=2,from_step=10", delay=2.0, from_step=10)),
        ("hang:at_step=7", Fault("hang", "hang:at_step=7", at_step=7)),
        ("mismatch:at_step=3", Fault("mismatch", "mismatch:at_step=3", at_step=3)),
        ("crash:at_step=0", Fault("crash", "crash:at_step=0", at_step=0)),
    ],
)
def test_valid_specs_parse(spec, expected):
    assert parse_fault(spec) == expected


@pytest.mark.parametrize(
    "spec, words",
    [
        ("explode:at_step=1", "unknown fault kind 'explode'"),
        ("hang", "has no parameters"),
        ("hang:", "has no parameters"),
        ("hang:step=3", "unknown parameter 'step'"),
        ("hang:at_step=three", "must be an integer"),
        ("slow:delay=fast", "must be a number"),
        ("slow:from_step=3", "slow needs delay"),
        ("hang:at_step=-1", "must be >= 0"),
        ("slow:delay=1,delay=2", "given twice"),
        ("hang:at_step", "is not KEY=VALUE"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(FaultSpecError, match=words.replace("(", r"\(")):
        parse_fault(spec)


def test_slow_applies_from_step_and_mismatch_only_at_its_step():
    slow = parse_fault("slow:delay=0,from_step=5")
    assert not slow.applies(4) and slow.applies(5) and slow.applies(50)
    injector = FaultInjector([parse_fault("mismatch:at_step=3")])
    assert [s for s in range(6) if injector.mismatch_at(s)] == [3]


def test_cli_rejects_a_bad_spec_before_starting(capsys):
    from lightkeeper.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--lighthouse", "http://127.0.0.1:1", "--inject", "hang:at=3"])
    assert exc.value.code == 2
    assert "unknown parameter 'at'" in capsys.readouterr().err

"""The device program builder and decoder (gpuhook.devrules.program), without a kernel.

Expected disassembly lives in tests/data/bpf: bpftool's own dump of the programs as the
kernel loaded them (see the README there), so the builder and the disassembler are both
checked against something gpuhook did not write.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhook.devrules import program
from gpuhook.devrules.devices import WILDCARD, DeviceRule
from gpuhook.devrules.program import Insn

from helpers.bpfdata import DATA, RULE_SETS, R, golden

# runc's default device rules (docs/runtime-facts.md §5) in the order its program tests them.
RUNC_DEFAULT_RULES = [
    R("b *:* m"), R("c *:* m"), R("c 1:3 rwm"), R("c 1:5 rwm"), R("c 1:7 rwm"), R("c 1:8 rwm"),
    R("c 1:9 rwm"), R("c 5:0 rwm"), R("c 5:2 rwm"), R("c 10:200 rwm"), R("c 136:* rwm"),
    R("a *:* rwm", allow=False),
]

# Instruction helpers for hand-written programs in the shapes other generators use.
ALU32_MOV_X = program.ALU | program.MOV | program.SRC_X
ALU32_AND_K = program.ALU | program.AND | program.SRC_K
ALU32_XOR_K = program.ALU | program.XOR | program.SRC_K
ALU32_MOV_K = program.ALU | program.MOV | program.SRC_K
ALU64_MOV_K = program.ALU64 | program.MOV | program.SRC_K
JNE_K = program.JMP | program.JNE | program.SRC_K
JNE_X = program.JMP | program.JNE | program.SRC_X
JEQ_K = program.JMP | program.JEQ | program.SRC_K
JSET_K = program.JMP | program.JSET | program.SRC_K
JA = program.JMP | program.JA
EXIT = Insn(program.JMP | program.EXIT)
PROLOGUE = list(program._PROLOGUE)


def runc_program() -> list:
    with open(f"{DATA}/runc-1.1.5-default.hex") as f:
        code = b"".join(bytes.fromhex(line.strip()) for line in f if line.strip() and not line.startswith("#"))
    return program.decode_bytes(code)


def systemd_program() -> list:
    """A device program in the shape systemd's src/core/bpf-devices.c builds (allow list,
    DevicePolicy=strict): guards end in `goto PASS`, then `r0 = 0; goto +1; PASS: r0 = 1;
    exit`. Rules: "/dev/char/195:0 rw", "char-pts rwm", "/dev/null rwm"."""
    body = PROLOGUE + [
        Insn(ALU32_MOV_X, 1, 3), Insn(ALU32_AND_K, 1, 0, 0, 6), Insn(JNE_X, 1, 3, 4),
        Insn(JNE_K, 2, 0, 3, 2), Insn(JNE_K, 4, 0, 2, 195), Insn(JNE_K, 5, 0, 1, 0), Insn(JA, off=None),
        Insn(JNE_K, 2, 0, 2, 2), Insn(JNE_K, 4, 0, 1, 136), Insn(JA, off=None),
        Insn(JNE_K, 2, 0, 3, 2), Insn(JNE_K, 4, 0, 2, 1), Insn(JNE_K, 5, 0, 1, 3), Insn(JA, off=None),
        Insn(ALU64_MOV_K, 0, 0, 0, 0), Insn(JA, off=1),
    ]
    passed = len(body)  # the `r0 = 1` that every "goto PASS" reaches
    body = [i._replace(off=passed - k - 1) if i.code == JA and i.off is None else i for k, i in enumerate(body)]
    return body + [Insn(ALU64_MOV_K, 0, 0, 0, 1), EXIT]


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_prefix_disassembles_exactly_as_bpftool_showed_it_loaded(name):
    built = program.prepend(RULE_SETS[name], program.DENY_ALL)
    assert program.disassemble(built) == golden(name)


def test_runc_program_disassembles_exactly_as_bpftool_shows_it():
    assert program.disassemble(runc_program()) == golden("runc-1.1.5-default")


def test_runc_program_decodes_to_runc_default_rules():
    decoded = program.decode(runc_program())
    assert decoded.complete
    assert decoded.rules == RUNC_DEFAULT_RULES


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_our_rules_in_front_of_runc_decode_to_ours_then_runcs(name):
    combined = program.prepend(RULE_SETS[name], runc_program())
    ours, whole = program.program_rules(combined)
    assert ours == RULE_SETS[name]
    assert whole == RULE_SETS[name] + RUNC_DEFAULT_RULES
    assert program.split(combined) == (combined[: len(combined) - len(runc_program())], runc_program())


def test_a_miss_in_every_block_lands_on_the_next_block_and_the_last_on_the_old_code():
    prefix = program.assemble(RULE_SETS["block-partial"])
    exits = [i for i, insn in enumerate(prefix) if insn == EXIT]
    assert exits[-1] == len(prefix) - 1 == prefix[1].imm - 1  # the marker's length is right
    for i, insn in enumerate(prefix):
        if insn.cls == program.JMP and insn.op == program.JNE:
            own_exit = min(e for e in exits if e > i)
            assert i + 1 + insn.off == own_exit + 1, program.disassemble(prefix)[i]


def test_rerun_replaces_our_prefix_with_the_union_instead_of_stacking_a_second():
    first = program.prepend([R("c 195:0 rw")], runc_program())
    ours, original = program.program_rules(first)[0], program.split(first)[1]
    second = program.prepend(ours + [R("c 195:1 r")], original)
    assert program.split(second)[1] == runc_program()
    assert program.program_rules(second)[0] == [R("c 195:0 rw"), R("c 195:1 r")]
    markers = [insn for insn in second if insn == Insn(ALU64_MOV_K, 0, 0, 0, program.MARKER)]
    assert len(markers) == 1


def test_program_without_our_marker_has_no_prefix():
    assert program.split(runc_program()) == ([], runc_program())
    assert program.program_rules(runc_program()) == ([], RUNC_DEFAULT_RULES)


def test_marker_with_an_impossible_length_is_an_error_not_a_guess():
    broken = [Insn(ALU64_MOV_K, 0, 0, 0, program.MARKER), Insn(ALU64_MOV_K, 0, 0, 0, 999)] + runc_program()
    with pytest.raises(program.DecodeError, match="bad prefix length 999"):
        program.split(broken)


WRITES_DST = (program.ALU, program.ALU64, program.LDX, program.LD)

rules_strategy = st.lists(
    st.builds(DeviceRule, st.sampled_from("abc"),
              st.one_of(st.just(WILDCARD), st.integers(0, 4095)),
              st.one_of(st.just(WILDCARD), st.integers(0, (1 << 20) - 1)),
              st.sets(st.sampled_from("rwm"), min_size=1).map("".join))
    .filter(lambda r: not (r.type == "a" and r.major == r.minor == WILDCARD and r.access == "rwm")),
    max_size=12)


@settings(max_examples=200, deadline=None)
@given(rules_strategy)
def test_prefix_never_writes_r1_and_decodes_back_to_its_rules(rules):
    prefix = program.assemble(rules)
    assert not [insn for insn in prefix if insn.cls in WRITES_DST and insn.dst == program.CONTEXT_REGISTER]
    for i, insn in enumerate(prefix):
        if insn.cls == program.JMP and insn.op == program.JNE:
            assert i < i + 1 + insn.off <= len(prefix)  # forward, and never past the old code's start
    ours, whole = program.program_rules(prefix + runc_program())
    assert ours == rules and whole == rules + RUNC_DEFAULT_RULES


@given(rules_strategy)
def test_instructions_survive_the_kernels_byte_layout(rules):
    insns = program.prepend(rules, runc_program())
    assert program.decode_bytes(program.encode(insns)) == insns


def test_deny_rules_and_allow_everything_are_not_ours_to_add():
    with pytest.raises(program.ProgramError, match="only adds allow rules"):
        program.assemble([R("c 195:0 rw", allow=False)])
    with pytest.raises(program.ProgramError, match="does not grant every device"):
        program.assemble([R("a *:* rwm")])


def test_systemd_shaped_program_decodes_with_its_goto_pass_blocks():
    decoded = program.decode(systemd_program())
    assert decoded.rules == [R("c 195:0 rw"), R("c 136:* rwm"), R("c 1:3 rwm"), R("a *:* rwm", allow=False)]


@pytest.mark.parametrize("check,allowed", [
    # runc/systemd: r1 = access; r1 &= A; if r1 != access goto miss
    ([Insn(ALU32_MOV_X, 1, 3), Insn(ALU32_AND_K, 1, 0, 0, 2), Insn(JNE_X, 1, 3, None)], "r"),
    # (access & forbidden) != 0 -> miss
    ([Insn(ALU32_MOV_X, 0, 3), Insn(ALU32_AND_K, 0, 0, 0, 1), Insn(JNE_K, 0, 0, None, 0)], "rw"),
    # if access & forbidden goto miss
    ([Insn(JSET_K, 3, 0, None, 4)], "rm"),
])
def test_access_checks_in_the_usual_spellings_decode(check, allowed):
    block = check + [Insn(JNE_K, 2, 0, None, 2), Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT]
    miss = len(block)
    block = [i._replace(off=miss - k - 1) if i.off is None else i for k, i in enumerate(block)]
    decoded = program.decode(PROLOGUE + block + list(program.DENY_ALL))
    assert decoded.rules == [DeviceRule("c", WILDCARD, WILDCARD, allowed), R("a *:* rwm", allow=False)]


@pytest.mark.parametrize("insns,message", [
    (PROLOGUE + [Insn(JEQ_K, 2, 0, 2, 2), Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT] + list(program.DENY_ALL),
     "not a device rule guard"),
    (PROLOGUE + [Insn(JNE_K, 2, 0, -3, 2), Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT], "jumps backwards"),
    (PROLOGUE + [Insn(JNE_K, 2, 0, 3, 2), Insn(JNE_K, 4, 0, 1, 195), Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT]
     + list(program.DENY_ALL), "jump to different places"),
    (PROLOGUE + [Insn(JNE_K, 2, 0, 2, 7), Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT] + list(program.DENY_ALL),
     "device type 7"),
    ([Insn(program.LDX | program.SIZE_W | program.MODE_MEM, 2, 1, 0), Insn(JNE_K, 2, 0, 2, 1),
      Insn(ALU32_MOV_K, 0, 0, 0, 1), EXIT] + list(program.DENY_ALL), "not a device rule guard"),
])
def test_shapes_the_decoder_does_not_know_are_reported_not_guessed(insns, message):
    with pytest.raises(program.DecodeError, match=message):
        program.decode(insns)


def blinded(insns: list) -> list:
    """What the JIT's constant blinding does to `if rX != IMM`: r11 = IMM ^ K; r11 ^= K;
    if rX != r11 (kernel/bpf/core.c, bpf_jit_blind_insn)."""
    out = []
    for insn in insns:
        if insn.code == JNE_K:
            out += [Insn(ALU32_MOV_K, 11, 0, 0, insn.imm ^ 0x5A5A), Insn(ALU32_XOR_K, 11, 0, 0, 0x5A5A),
                    Insn(JNE_X, insn.dst, 11, insn.off)]
        else:
            out.append(insn)
    return out


def test_blinded_program_is_refused_with_the_sysctl_named():
    with pytest.raises(program.BlindedProgram, match=r"register 11.*bpf_jit_harden=2"):
        program.check_rebuildable(blinded(runc_program()))


def test_plain_programs_are_rebuildable():
    program.check_rebuildable(runc_program())
    program.check_rebuildable(systemd_program())
    program.check_rebuildable(program.prepend(RULE_SETS["wildcards"], runc_program()))


@pytest.mark.parametrize("insn,message", [
    (Insn(program.JMP | program.CALL, imm=14), "calls a function"),
    (Insn(program.LD | program.SIZE_DW | program.MODE_IMM, 1, 1, 0, 7), "map or function"),
])
def test_programs_with_helper_calls_or_maps_are_refused(insn, message):
    insns = PROLOGUE + [insn, Insn(0)] + list(program.DENY_ALL)
    with pytest.raises(program.ProgramError, match=message):
        program.check_rebuildable(insns)


@pytest.mark.parametrize("rules,request_,expected", [
    ([R("c 195:0 rw")], R("c 195:0 rw"), True),
    ([R("c 195:0 rw")], R("c 195:0 r"), True),
    ([R("c 195:0 r")], R("c 195:0 rw"), False),
    ([R("c 195:0 rw")], R("c 195:* rw"), False),
    ([R("c 195:* rwm")], R("c 195:7 rw"), True),
    ([R("b 195:* rwm")], R("c 195:7 rw"), False),
    ([R("a *:* r")], R("b 8:0 r"), True),
    ([R("c 195:1 rwm", allow=False), R("c 195:* rwm")], R("c 195:* rw"), False),
    ([R("c 195:1 rwm", allow=False), R("c 195:* rwm")], R("c 195:2 rw"), True),
    ([R("c 195:1 rwm", allow=False), R("c 195:* rwm")], R("c 195:1 r"), False),
    (RUNC_DEFAULT_RULES, R("c 1:3 rw"), True),
    (RUNC_DEFAULT_RULES, R("c 195:0 rw"), False),
    (RUNC_DEFAULT_RULES, R("c 195:0 m"), True),
    ([], R("c 1:3 r"), False),
])
def test_allows_answers_for_every_access_the_kernel_may_ask(rules, request_, expected):
    assert program.allows(rules, request_) is expected

"""Device cgroup eBPF programs as data: build our allow prefix, decode programs into rules.

Pure code, no system calls (gpuhook.apply.cgroup.bpf loads and attaches). On cgroup v2 every
device program attached to a container's cgroup must allow an access (docs/runtime-facts.md
§5), so a grant cannot add a program: it rebuilds each attached one as

    [our prefix: one allow block per rule] + [the program's own instructions, unchanged]

A block that matches returns 1 (allow); a miss jumps to the next block, and the last miss
lands on the old program's first instruction, which starts from scratch (it reloads the
context through r1, so the prefix never writes r1). Jumps in the old code are relative, so
they stay valid behind the prefix.

The prefix starts with two marker instructions, ``r0 = MARKER`` and ``r0 = <prefix length>``
(dead stores the verifier keeps), so a second run finds our own prefix, decodes the rules
in it and replaces it with the union instead of stacking a second prefix. The program is
also loaded under the name PROGRAM_NAME, which bpftool shows.

The decoder reads the decision lists that runc, systemd and this module generate: blocks
of "if <field> != <value> goto <next block>" guards ending in a constant verdict (returned
directly or by a jump to a shared `r0 = 1; exit`), the last one unguarded (the default).
Anything else is reported as undecodable, never guessed. `disassemble` prints instructions
the way ``bpftool prog dump xlated`` does.
"""

import struct

from gpuhook.devrules.devices import ACCESS_ORDER, WILDCARD, DeviceRule
from gpuhook.record import record

PROGRAM_NAME = "gpuhook_dev"
# "gpuh" read as a little-endian word; any constant would do, this one is greppable.
MARKER = 0x68757067
HEADER_LENGTH = 2

# struct bpf_cgroup_dev_ctx {u32 access_type = access << 16 | type; u32 major; u32 minor}
CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR = 0, 4, 8
DEV_BLOCK, DEV_CHAR = 1, 2
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
ALL_ACCESS = ACC_MKNOD | ACC_READ | ACC_WRITE
_ACCESS_BITS = {"r": ACC_READ, "w": ACC_WRITE, "m": ACC_MKNOD}
_TYPE_CODES = {"b": DEV_BLOCK, "c": DEV_CHAR}

# Instruction encoding (include/uapi/linux/bpf_common.h, bpf.h).
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
SIZE_W, SIZE_H, SIZE_B, SIZE_DW = 0x00, 0x08, 0x10, 0x18
MODE_IMM, MODE_ABS, MODE_IND, MODE_MEM, MODE_MEMSX, MODE_ATOMIC = 0x00, 0x20, 0x40, 0x60, 0x80, 0xC0
SRC_K, SRC_X = 0x00, 0x08
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR, MOV, ARSH, END = range(0x00, 0xE0, 0x10)
JA, JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, CALL, EXIT, JLT, JLE, JSLT, JSLE = range(0x00, 0xE0, 0x10)
# The register the JIT's constant blinding uses (BPF_REG_AX); programs never name it.
BLINDING_REGISTER = 11
CONTEXT_REGISTER = 1

_ALU_SYMBOLS = {ADD: "+=", SUB: "-=", MUL: "*=", DIV: "/=", OR: "|=", AND: "&=", LSH: "<<=",
                RSH: ">>=", MOD: "%=", XOR: "^=", MOV: "=", ARSH: "s>>="}
_JMP_SYMBOLS = {JEQ: "==", JGT: ">", JGE: ">=", JSET: "&", JNE: "!=", JSGT: "s>", JSGE: "s>=",
                JLT: "<", JLE: "<=", JSLT: "s<", JSLE: "s<="}
_SIZE_NAMES = {SIZE_W: "u32", SIZE_H: "u16", SIZE_B: "u8", SIZE_DW: "u64"}
_INSN = struct.Struct("<BBhi")


class ProgramError(ValueError):
    """A device program that gpuhook cannot rebuild or read; the message says why."""


class BlindedProgram(ProgramError):
    """The program's translated code went through JIT constant blinding (register 11)."""


class DecodeError(ProgramError):
    """The program is not a decision list over the device context that gpuhook can read."""


class Insn(record("Insn", "code dst src off imm")):
    """One eBPF instruction (struct bpf_insn): opcode, registers, offset, immediate."""

    __slots__ = ()

    def __new__(cls, code, dst=0, src=0, off=0, imm=0):
        return super().__new__(cls, code, dst, src, off, imm)

    @property
    def cls(self) -> int:
        return self.code & 0x07

    @property
    def op(self) -> int:
        return self.code & 0xF0

    @property
    def uses_register_source(self) -> bool:
        return bool(self.code & SRC_X)


def encode(insns) -> bytes:
    """The kernel's byte layout (little-endian: dst_reg in the low nibble)."""
    return b"".join(_INSN.pack(i.code, (i.src << 4) | i.dst, i.off, i.imm) for i in insns)


def decode_bytes(data: bytes) -> list:
    """Instructions from the kernel's byte layout (xlated_prog_insns)."""
    if len(data) % _INSN.size:
        raise ProgramError(f"program text of {len(data)} bytes is not a whole number of instructions")
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(data):
        out.append(Insn(code, regs & 0x0F, regs >> 4, off, imm))
    return out


# --- building -------------------------------------------------------------------------------

def _mov64_imm(dst, imm):
    return Insn(ALU64 | MOV | SRC_K, dst, 0, 0, imm)


def _mov32_imm(dst, imm):
    return Insn(ALU | MOV | SRC_K, dst, 0, 0, imm)


def _mov32_reg(dst, src):
    return Insn(ALU | MOV | SRC_X, dst, src)


def _alu32_imm(op, dst, imm):
    return Insn(ALU | op | SRC_K, dst, 0, 0, imm)


def _load_word(dst, offset):
    return Insn(LDX | SIZE_W | MODE_MEM, dst, CONTEXT_REGISTER, offset)


def _jne_imm(dst, imm, off):
    return Insn(JMP | JNE | SRC_K, dst, 0, off, imm)


def _jne_reg(dst, src, off):
    return Insn(JMP | JNE | SRC_X, dst, src, off)


EXIT_INSN = Insn(JMP | EXIT)
# Registers of the prefix: the context's fields and one scratch. r1 holds the context for
# the old code and is never written (the verifier rejects the old code's loads through a
# clobbered r1 with EACCES, "R1 invalid mem access 'scalar'").
R_TYPE, R_ACCESS, R_MAJOR, R_MINOR, R_SCRATCH = 2, 3, 4, 5, 0
_PROLOGUE = (
    _load_word(R_TYPE, CTX_ACCESS_TYPE), _alu32_imm(AND, R_TYPE, 0xFFFF),
    _load_word(R_ACCESS, CTX_ACCESS_TYPE), _alu32_imm(RSH, R_ACCESS, 16),
    _load_word(R_MAJOR, CTX_MAJOR), _load_word(R_MINOR, CTX_MINOR),
)
# A complete program that denies everything: what a prefix needs behind it to load alone.
DENY_ALL = (_mov32_imm(0, 0), EXIT_INSN)


def access_bits(access: str) -> int:
    bits = 0
    for letter in access:
        bits |= _ACCESS_BITS[letter]
    return bits


def access_letters(bits: int) -> str:
    return "".join(c for c in ACCESS_ORDER if bits & _ACCESS_BITS[c])


def _block(rule: DeviceRule) -> list:
    """Guards (jump offsets are patched by the caller to reach the next block) and verdict."""
    guards = []
    if rule.type != "a":
        guards.append(_jne_imm(R_TYPE, _TYPE_CODES[rule.type], 0))
    bits = access_bits(rule.access)
    if bits != ALL_ACCESS:
        # The requested access must be a subset of the rule's: (access & bits) == access.
        guards += [_mov32_reg(R_SCRATCH, R_ACCESS), _alu32_imm(AND, R_SCRATCH, bits),
                   _jne_reg(R_SCRATCH, R_ACCESS, 0)]
    if rule.major != WILDCARD:
        guards.append(_jne_imm(R_MAJOR, rule.major, 0))
    if rule.minor != WILDCARD:
        guards.append(_jne_imm(R_MINOR, rule.minor, 0))
    return guards + [_mov32_imm(0, 1), EXIT_INSN]


def assemble(rules) -> list:
    """Our prefix for allow `rules`: marker, context loads, one block per rule; a miss of the
    last block falls through to whatever follows the prefix."""
    rules = list(rules)
    for rule in rules:
        if not rule.allow:
            raise ProgramError(f"gpuhook only adds allow rules, not {rule}")
        if rule.type == "a" and rule.major == rule.minor == WILDCARD and rule.access == ACCESS_ORDER:
            # A block without guards would end the program: the old code behind it would be
            # dead, and the verifier removes dead code, so the original could not be kept.
            raise ProgramError("gpuhook does not grant every device (a *:* rwm); use a privileged container")
        for number in (rule.major, rule.minor):
            # Guards compare with a sign-extended 32-bit immediate.
            if number != WILDCARD and not 0 <= number < 1 << 31:
                raise ProgramError(f"device number {number} out of range in {rule}")
    body = list(_PROLOGUE)
    for rule in rules:
        block = _block(rule)
        start = len(body)
        end = start + len(block)  # the next block, or the old program
        for k, insn in enumerate(block):
            if insn.op == JNE and insn.cls == JMP:
                block[k] = insn._replace(off=end - (start + k) - 1)
        body += block
    length = HEADER_LENGTH + len(body)
    return [_mov64_imm(0, MARKER), _mov64_imm(0, length)] + body


def prepend(rules, original) -> list:
    """`original` with our allow blocks for `rules` in front (see the module docstring)."""
    return assemble(rules) + list(original)


def split(insns) -> tuple:
    """(our prefix, the original program) of a program; the prefix is [] if it has none."""
    insns = list(insns)
    if len(insns) < HEADER_LENGTH or insns[0] != _mov64_imm(0, MARKER):
        return [], insns
    length = insns[1].imm if insns[1].code == ALU64 | MOV | SRC_K and insns[1].dst == 0 else -1
    if not HEADER_LENGTH <= length <= len(insns):
        raise DecodeError(f"gpuhook marker with a bad prefix length {length}")
    return insns[:length], insns[length:]


def check_rebuildable(insns) -> None:
    """Raise unless the translated instructions can be loaded again as they are.

    Blinded code (net.core.bpf_jit_harden=2) holds register 11, which a loaded program may
    not name. Helper calls and map references are rewritten to kernel addresses in the
    translated dump, so they could not be reloaded either. Device programs need neither.
    """
    skip = False
    for index, insn in enumerate(insns):
        if skip:
            skip = False
            continue
        if BLINDING_REGISTER in (insn.dst, insn.src):
            raise BlindedProgram(
                f"instruction {index} uses register 11: the kernel blinded the program's constants "
                f"(net.core.bpf_jit_harden=2), so its code cannot be loaded again")
        if insn.dst > 10 or insn.src > 10:
            raise ProgramError(f"instruction {index} names register {max(insn.dst, insn.src)}")
        if insn.cls in (JMP, JMP32) and insn.op == CALL:
            raise ProgramError(f"instruction {index} calls a function; gpuhook only rebuilds plain device programs")
        if insn.code == LD | SIZE_DW | MODE_IMM:
            if insn.src != 0:
                raise ProgramError(f"instruction {index} refers to a map or function; gpuhook only rebuilds "
                                   f"plain device programs")
            skip = True
        elif insn.cls == LD:
            raise ProgramError(f"instruction {index} is a packet load, not valid in a device program")


# --- decoding -------------------------------------------------------------------------------

# Symbolic register values while decoding.
_CTX = ("ctx",)
_WORD = ("field", "access_type")
_TYPE = ("field", "type")
_ACCESS = ("field", "access")
_MAJOR = ("field", "major")
_MINOR = ("field", "minor")


class Decoded(record("Decoded", "rules complete")):
    """`rules` in program order (first match wins); `complete` is False when the code ran
    off its end (a prefix that falls through) instead of ending in an unguarded verdict."""

    __slots__ = ()


def decode(insns, stop: int | None = None) -> Decoded:
    """Read a device program back into rules; raise DecodeError when it has another shape.

    `stop` is the index where decoding ends with the rules so far (the end of our prefix).
    """
    insns = list(insns)
    end = len(insns) if stop is None else stop
    regs = {CONTEXT_REGISTER: _CTX}
    rules = []
    i = 0
    guards, miss, written = [], None, set()
    while True:
        if i == end and not guards:
            return Decoded(rules, False)
        if not 0 <= i < end:
            raise DecodeError(f"control reaches instruction {i}, outside the program")
        verdict = _verdict_at(insns, i)
        if verdict is not None:
            rules.append(_rule(guards, verdict))
            if not guards:
                return Decoded(rules, True)
            i = miss
            # A guard may have jumped before the block's own assignments ran.
            for reg in written:
                regs.pop(reg, None)
            guards, miss, written = [], None, set()
            continue
        insn = insns[i]
        if insn.cls in (JMP, JMP32) and insn.op not in (JA, CALL, EXIT):
            target = i + 1 + insn.off
            if target <= i:
                raise DecodeError(f"instruction {i} jumps backwards")
            if miss is not None and target != miss:
                raise DecodeError(f"instruction {i}: guards of one block jump to different places")
            guards.append(_guard(insn, regs, i))
            miss = target
        elif insn.cls in (ALU, ALU64, LDX):
            value = _evaluate(insn, regs)
            regs[insn.dst] = value
            if guards:
                written.add(insn.dst)
        else:
            raise DecodeError(f"instruction {i} ({_text(insns, i)}) is not part of a device rule list")
        i += 1


def _verdict_at(insns, i):
    """The constant returned when execution from `i` reaches exit with no decision, else None."""
    r0 = None
    seen = 0
    while 0 <= i < len(insns) and seen < len(insns):
        insn = insns[i]
        seen += 1
        if insn.code in (ALU | MOV | SRC_K, ALU64 | MOV | SRC_K) and insn.dst == 0:
            r0 = insn.imm
            i += 1
        elif insn.code == JMP | JA:
            i += 1 + insn.off
        elif insn.code == JMP | EXIT:
            return None if r0 is None else bool(r0)
        else:
            return None
    return None


def _evaluate(insn, regs):
    """Symbolic value of an assignment; None (unknown) where it does not matter to a rule."""
    if insn.cls == LDX:
        if regs.get(insn.src) != _CTX:
            return None
        size, off = insn.code & 0x18, insn.off
        if size == SIZE_W:
            return {CTX_ACCESS_TYPE: _WORD, CTX_MAJOR: _MAJOR, CTX_MINOR: _MINOR}.get(off)
        if size == SIZE_H:  # narrow loads of access_type (little-endian halves)
            return {CTX_ACCESS_TYPE: _TYPE, CTX_ACCESS_TYPE + 2: _ACCESS}.get(off)
        return None
    source = regs.get(insn.src) if insn.uses_register_source else ("const", insn.imm)
    current = regs.get(insn.dst)
    if insn.op == MOV:
        return source
    if insn.uses_register_source:
        return None
    if insn.op == AND and current == _WORD and insn.imm == 0xFFFF:
        return _TYPE
    if insn.op == RSH and current == _WORD and insn.imm == 16:
        return _ACCESS
    if insn.op == AND and current == _ACCESS:
        return ("masked", insn.imm & ALL_ACCESS)
    if insn.op == AND and current is not None and current[0] == "masked":
        return ("masked", current[1] & insn.imm & ALL_ACCESS)
    return None


def _guard(insn, regs, i) -> tuple:
    """The condition that falls through a guard, as (what, value)."""
    left = regs.get(insn.dst)
    right = regs.get(insn.src) if insn.uses_register_source else ("const", insn.imm)
    if insn.op == JNE:
        if right and right[0] == "const":
            value = right[1] & 0xFFFFFFFF
            if left == _TYPE:
                if value not in (DEV_BLOCK, DEV_CHAR):
                    raise DecodeError(f"instruction {i} tests for device type {value}")
                return ("type", "b" if value == DEV_BLOCK else "c")
            if left == _MAJOR:
                return ("major", value)
            if left == _MINOR:
                return ("minor", value)
            if left and left[0] == "masked" and value == 0:
                # (access & forbidden) != 0 -> miss: what is left is allowed.
                return ("access", ALL_ACCESS & ~left[1])
        if left and left[0] == "masked" and right == _ACCESS:
            return ("access", left[1])
    if insn.op == JSET and not insn.uses_register_source and left == _ACCESS:
        return ("access", ALL_ACCESS & ~insn.imm)
    raise DecodeError(f"instruction {i} ({_format(insn)}) is not a device rule guard")


def _rule(guards, verdict) -> DeviceRule:
    found = {"type": "a", "major": WILDCARD, "minor": WILDCARD, "access": ALL_ACCESS}
    for what, value in guards:
        if what == "access":
            found["access"] &= value
        elif found[what] not in ("a", WILDCARD) and found[what] != value:
            raise DecodeError(f"one block tests {what} against two values")
        else:
            found[what] = value
    if found["access"] == 0:
        raise DecodeError("a block that no access can match")
    return DeviceRule(found["type"], found["major"], found["minor"], access_letters(found["access"]), verdict)


def program_rules(insns) -> tuple:
    """(our prefix's rules, the whole program's rules in order) of translated instructions.

    The whole list is None when the original part cannot be decoded; our own prefix always
    can, or DecodeError is raised.
    """
    prefix, original = split(insns)
    ours = decode(prefix, stop=len(prefix)).rules if prefix else []
    try:
        rest = decode(original)
    except DecodeError:
        return ours, None
    return ours, (ours + rest.rules) if rest.complete else None


# --- evaluating -----------------------------------------------------------------------------

def _matches_every(rule: DeviceRule, request: DeviceRule) -> bool:
    """Every device `request` names would match `rule`'s block (access checked by the caller)."""
    return ((rule.type == "a" or rule.type == request.type)
            and (rule.major == WILDCARD or rule.major == request.major)
            and (rule.minor == WILDCARD or rule.minor == request.minor))


def _matches_some(rule: DeviceRule, request: DeviceRule) -> bool:
    return ((rule.type == "a" or request.type == "a" or rule.type == request.type)
            and (WILDCARD in (rule.major, request.major) or rule.major == request.major)
            and (WILDCARD in (rule.minor, request.minor) or rule.minor == request.minor))


def allows(rules, request: DeviceRule) -> bool:
    """True if the decision list `rules` (first match wins) allows every access `request`
    asks for, on every device it names. Conservative: False when unsure."""
    wanted = access_bits(request.access)
    # The kernel asks about one access set at a time (an O_RDWR open asks for rw at once).
    for bits in range(1, ALL_ACCESS + 1):
        if bits & ~wanted:
            continue
        verdict = False
        for rule in rules:
            if bits & ~access_bits(rule.access):
                continue  # this block does not match this access set
            if _matches_every(rule, request):
                verdict = rule.allow
                break
            if not rule.allow and _matches_some(rule, request):
                break  # a deny takes part of the request before anything allows all of it
        if not verdict:
            return False
    return True


# --- disassembling --------------------------------------------------------------------------

def _reg(insn_class, number) -> str:
    return f"{'w' if insn_class in (ALU, JMP32) else 'r'}{number}"


def _format(insn, next_insn=None) -> str:
    """One instruction as bpftool prints it (without the index), e.g. "(61) r2 = *(u32 *)(r1 +0)"."""
    c = insn.cls
    head = f"({insn.code:02x})"
    if c in (ALU, ALU64):
        if insn.op == END:
            if c == ALU64:
                return f"{head} r{insn.dst} = bswap{insn.imm} r{insn.dst}"
            return f"{head} r{insn.dst} = {'be' if insn.uses_register_source else 'le'}{insn.imm} r{insn.dst}"
        if insn.op == NEG:
            return f"{head} {_reg(c, insn.dst)} = -{_reg(c, insn.dst)}"
        symbol = _ALU_SYMBOLS.get(insn.op, "?=")
        if insn.uses_register_source:
            return f"{head} {_reg(c, insn.dst)} {symbol} {_reg(c, insn.src)}"
        return f"{head} {_reg(c, insn.dst)} {symbol} {insn.imm}"
    if c in (JMP, JMP32):
        if insn.code == JMP | JA:
            return f"{head} goto pc{insn.off:+d}"
        if insn.code == JMP32 | JA:
            return f"{head} gotol pc{insn.imm:+d}"
        if insn.op == EXIT:
            return f"{head} exit"
        if insn.op == CALL:
            return f"{head} call #{insn.imm}"
        symbol = _JMP_SYMBOLS.get(insn.op, "?")
        right = _reg(c, insn.src) if insn.uses_register_source else f"0x{insn.imm & 0xFFFFFFFF:x}"
        return f"{head} if {_reg(c, insn.dst)} {symbol} {right} goto pc{insn.off:+d}"
    size = _SIZE_NAMES[insn.code & 0x18]
    mode = insn.code & 0xE0
    if c == LDX and mode == MODE_MEMSX:
        return f"{head} r{insn.dst} = *(s{size[1:]} *)(r{insn.src} {insn.off:+d})"
    if c == LDX and mode == MODE_MEM:
        return f"{head} r{insn.dst} = *({size} *)(r{insn.src} {insn.off:+d})"
    if c == ST and mode == MODE_MEM:
        return f"{head} *({size} *)(r{insn.dst} {insn.off:+d}) = {insn.imm}"
    if c == STX and mode == MODE_MEM:
        return f"{head} *({size} *)(r{insn.dst} {insn.off:+d}) = r{insn.src}"
    if insn.code == LD | SIZE_DW | MODE_IMM and next_insn is not None:
        value = (next_insn.imm & 0xFFFFFFFF) << 32 | (insn.imm & 0xFFFFFFFF)
        return f"{head} r{insn.dst} = 0x{value:x}"
    return f"{head} code {insn.code:#04x} dst r{insn.dst} src r{insn.src} off {insn.off} imm {insn.imm}"


def _text(insns, i) -> str:
    return _format(insns[i], insns[i + 1] if i + 1 < len(insns) else None)


def disassemble(insns) -> list:
    """Lines like ``bpftool prog dump xlated``: "   0: (61) r2 = *(u32 *)(r1 +0)"."""
    insns = list(insns)
    lines = []
    i = 0
    while i < len(insns):
        lines.append(f"{i:4d}: {_text(insns, i)}")
        i += 2 if insns[i].code == LD | SIZE_DW | MODE_IMM else 1
    return lines

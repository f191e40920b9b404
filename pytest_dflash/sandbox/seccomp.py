"""A seccomp filter for sandboxed programs: no new processes, no exec, no kernel attack surface.

Why a filter of our own: a HumanEval program needs arithmetic, strings, files in its own
directory and threads, nothing else. The in-process guards of :mod:`pytest_dflash.sandbox.executor`
can be
bypassed from Python (re-importing ``posix`` restores ``posix.system``); a seccomp filter cannot
be removed by the process it is installed in. The filter is a plain classic-BPF program built
here (no libseccomp binding is needed) and installed by the sandbox bootstrap with
``prctl(PR_SET_SECCOMP)`` right before the program's first line.

What it refuses (errno EPERM unless noted):

- a new process: ``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD`` (threads still work),
  ``clone3`` (ENOSYS, so the C library falls back to ``clone``, which the filter can inspect);
- ``execve``/``execveat``: no other program can start;
- other processes' memory and namespaces: ``ptrace``, ``process_vm_*``, ``kcmp``,
  ``pidfd_getfd``, ``unshare``, ``setns``, ``mount`` and the new mount API, ``pivot_root``,
  ``chroot``, ``open_by_handle_at``;
- kernel surface an unprivileged process can reach: ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_*``, the keyring calls, ``personality``;
- administrative calls (modules, kexec, reboot, swap, clocks, hostname), refused anyway without
  capabilities.

A system call of another ABI (i386 or x32 on x86-64) kills the process: the numbers above would
not mean the same calls there. Machines other than x86-64 and aarch64 get no filter, and the
sandbox's isolation line says so.
"""

from __future__ import annotations

import errno
import platform
import struct

DENIED: tuple[str, ...] = (
    "fork", "vfork", "execve", "execveat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at",
    "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "add_key", "request_key", "keyctl", "personality", "lookup_dcookie",
    "swapon", "swapoff", "reboot", "sethostname", "setdomainname", "iopl", "ioperm", "modify_ldt",
    "init_module", "delete_module", "finit_module", "kexec_load", "kexec_file_load", "acct",
    "quotactl", "syslog", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "vhangup",
)

# System call numbers (checked against the kernel headers by tests/test_sandbox.py where the
# headers are installed). A name missing from a table does not exist on that machine.
_X86_64 = {
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone": 56, "clone3": 435,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_getfd": 438, "process_madvise": 440, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "unshare": 272, "setns": 308, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
    "delete_module": 176, "finit_module": 313, "kexec_load": 246, "kexec_file_load": 320,
    "acct": 163, "quotactl": 179, "syslog": 103, "settimeofday": 164, "clock_settime": 227,
    "adjtimex": 159, "clock_adjtime": 305, "add_key": 248, "request_key": 249, "keyctl": 250,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "modify_ldt": 154,
    "lookup_dcookie": 212, "vhangup": 153, "personality": 135,
}
_AARCH64 = {
    "execve": 221, "execveat": 281, "clone": 220, "clone3": 435, "ptrace": 117,
    "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
    "process_madvise": 440, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "unshare": 97, "setns": 268, "swapon": 224, "swapoff": 225, "reboot": 142,
    "sethostname": 161, "setdomainname": 162, "init_module": 105, "delete_module": 106,
    "finit_module": 273, "kexec_load": 104, "kexec_file_load": 294, "acct": 89, "quotactl": 60,
    "syslog": 116, "settimeofday": 170, "clock_settime": 112, "adjtimex": 171,
    "clock_adjtime": 266, "add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280,
    "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_by_handle_at": 265, "name_to_handle_at": 264,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "lookup_dcookie": 18, "vhangup": 58, "personality": 92,
}
#: machine -> (AUDIT_ARCH value, syscall table, lowest number of a foreign ABI or None)
ARCHES: dict[str, tuple[int, dict[str, int], int | None]] = {
    "x86_64": (0xC000003E, _X86_64, 0x40000000),  # x32 calls carry bit 30
    "aarch64": (0xC00000B7, _AARCH64, None),
}

CLONE_THREAD = 0x00010000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian machines)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as ``struct sock_filter[]`` bytes for ``machine`` (default: this one), or None
    if the machine has no table here."""
    spec = ARCHES.get(machine or platform.machine())
    if spec is None:
        return None
    audit_arch, table, foreign = spec
    eperm = _RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ, audit_arch, 1, 0),
        _insn(_RET, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _NR),
    ]
    if foreign is not None:
        prog += [_insn(_JGE, foreign, 0, 1), _insn(_RET, _RET_KILL_PROCESS)]
    for name in DENIED:
        if name in table:
            prog += [_insn(_JEQ, table[name], 0, 1), _insn(_RET, eperm)]
    prog += [_insn(_JEQ, table["clone3"], 0, 1), _insn(_RET, _RET_ERRNO | errno.ENOSYS)]
    prog += [
        _insn(_JEQ, table["clone"], 0, 4),
        _insn(_LD_W_ABS, _ARG0_LOW),
        _insn(_JSET, CLONE_THREAD, 1, 0),
        _insn(_RET, eperm),
        _insn(_RET, _RET_ALLOW),
        _insn(_RET, _RET_ALLOW),
    ]
    return b"".join(prog)


#: Runs inside the sandboxed interpreter (the bootstrap pastes it in): installs ``program`` (hex).
INSTALL_SOURCE = r"""
def _install_seccomp(hex_program):
    import ctypes
    code = bytes.fromhex(hex_program)
    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Fprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(22, 2, ctypes.addressof(prog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
"""

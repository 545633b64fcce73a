"""The seccomp filter of a sandboxed call (forge_core/sandbox.py): the syscalls that no tool needs fail with EPERM
(`DENIED_SYSCALLS`: bpf, io_uring, userfaultfd, perf_event_open, the kernel keyring, ptrace, mounts, kexec, kernel
modules), and a process that makes another architecture's syscalls (x32, int 0x80) is killed. libseccomp
(Debian's libseccomp2, which apt needs) builds it, as it knows each architecture's numbers; the call's ENTER step
loads the program (prctl PR_SET_SECCOMP), which then holds for every process the call starts.

    bpf_hex = syscall_filter()      # a struct sock_filter array, in hex
"""

import ctypes
import ctypes.util
import errno
import tempfile
from functools import cache

__all__ = ["DENIED_SYSCALLS", "syscall_filter"]

DENIED_SYSCALLS = ("bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
                   "keyctl", "add_key", "request_key", "ptrace", "mount", "umount2", "pivot_root", "fsopen",
                   "fsconfig", "fsmount", "move_mount", "open_tree", "mount_setattr", "kexec_load", "kexec_file_load",
                   "init_module", "finit_module", "delete_module")
_SCMP_ACT_ALLOW, _SCMP_ACT_KILL_PROCESS, _SCMP_ACT_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM
_SCMP_FLTATR_ACT_BADARCH, _NR_SCMP_ERROR = 2, -1


@cache
def syscall_filter() -> str:
    """The filter as a BPF program in hex. OSError where libseccomp is missing or cannot build it."""
    library = ctypes.util.find_library("seccomp")
    if library is None:
        raise OSError("libseccomp is not installed (Debian: apt-get install libseccomp2)")
    seccomp = ctypes.CDLL(library)
    seccomp.seccomp_init.restype = ctypes.c_void_p
    context = ctypes.c_void_p(seccomp.seccomp_init(ctypes.c_uint32(_SCMP_ACT_ALLOW)))
    try:
        seccomp.seccomp_attr_set(context, _SCMP_FLTATR_ACT_BADARCH, ctypes.c_uint32(_SCMP_ACT_KILL_PROCESS))
        for name in DENIED_SYSCALLS:
            number = seccomp.seccomp_syscall_resolve_name(name.encode())
            if number == _NR_SCMP_ERROR or seccomp.seccomp_rule_add(context, ctypes.c_uint32(_SCMP_ACT_EPERM),
                                                                    number, 0) < 0:
                raise OSError(f"libseccomp cannot deny the syscall {name}")
        with tempfile.TemporaryFile() as program:
            if seccomp.seccomp_export_bpf(context, program.fileno()) < 0:
                raise OSError("libseccomp cannot build the seccomp filter")
            program.seek(0)
            return program.read().hex()
    finally:
        seccomp.seccomp_release(context)

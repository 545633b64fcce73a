"""The root a sandboxed call (forge_core/sandbox.py) runs in, the mount table it is built from, and the paths of
the tools that the call's command runs (its environment is empty).

`private_root` is a `sh -c` step of the call's command, run inside its new mount namespace while still privileged
there: it builds the root on a tmpfs at NEW_ROOT and chroots into it. The root holds the system directories (/usr,
/lib...), the program's and the interpreter's own installations (a venv and the interpreter it links to), /proc,
/dev/null and /dev/urandom, all bound read-only (each mount under them too, with its own flags kept), a copy of the
few files of /etc that programs read (`ETC_NEEDED`; not the rest of /etc, where a container's secrets are often
mounted), and a tmpfs of `disk_mb`, owned by the code's uid, on /tmp and /dev/shm: everything the code writes is
there and is gone with the mount namespace. The caller's files, the job's data and every other mount are not in it.

    command = [*namespaces, *private_root(64, 60000, "/usr/bin/python3", "/usr/bin/python3", then), *rest]
"""

import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Iterator

__all__ = ["SYSTEM_DIRS", "ETC_NEEDED", "private_root", "mountinfo", "tool"]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")   # what programs run from
ETC_NEEDED = ("ld.so.cache", "localtime", "python3*")    # what of /etc they read: the loader's cache, the time zone,
                                                         # Debian's Python configuration (its sitecustomize)
DEVICES = ("/dev/null", "/dev/urandom")
NEW_ROOT = "/sys"       # where the root is built, hiding /sys in this mount namespace: no program is installed
                        # there, where /tmp may hold one (a venv in a clone under /tmp)


def private_root(disk_mb: int, uid: int | None, python: str, program: str, then: list[str]) -> list[str]:
    """The step that builds the root for `program` (run by `python`) with a /tmp of disk_mb owned by `uid` (None:
    the namespace's root), chroots into it and runs `then` there with the rest of the command as its arguments.
    OSError: a tool is missing, or a program is not installed under a directory of its own."""
    mount, owner = tool("mount"), f",uid={uid},gid={uid}" if uid is not None else ""
    shown = list(dict.fromkeys([*(top for top in SYSTEM_DIRS if os.path.lexists(top)), *_installation(python),
                                *_installation(program)]))
    links, dirs = [top for top in shown if os.path.islink(top)], [top for top in shown if not os.path.islink(top)]
    etc = sorted(str(path) for pattern in ETC_NEEDED for path in Path("/etc").glob(pattern))
    devices = [device for device in DEVICES if os.path.exists(device)]
    steps = [["umask", "022"], [mount, "-t", "tmpfs", "-o", "size=1m,mode=0755,nosuid,nodev", "tmpfs", NEW_ROOT],
             [tool("mkdir"), "-p", *(NEW_ROOT + d for d in ("/proc", "/dev/shm", "/tmp", "/etc"))],
             *([[tool("cp"), "-RP", "--preserve=mode", *etc, NEW_ROOT + "/etc"]] if etc else []),
             [mount, "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0700,nosuid,nodev{owner}", "tmpfs", NEW_ROOT + "/tmp"],
             [mount, "--bind", NEW_ROOT + "/tmp", NEW_ROOT + "/dev/shm"],
             [tool("mkdir"), "-p", *(NEW_ROOT + d for d in dirs)],      # after /tmp: an installation may be in it
             *([[tool("cp"), "-P", *links, NEW_ROOT]] if links else []),
             *([mount, "--rbind", d, NEW_ROOT + d] for d in dirs),
             *([mount, "-o", f"remount,bind,{options}", NEW_ROOT + point] for point, options in _read_only(dirs)),
             [tool("touch"), *(NEW_ROOT + device for device in devices)],
             *([mount, "--bind", device, NEW_ROOT + device] for device in devices),
             [mount, "--rbind", "/proc", NEW_ROOT + "/proc"],
             [mount, "-o", "remount,bind,ro,nosuid,nodev", NEW_ROOT],
             ["exec", tool("chroot"), NEW_ROOT, *then]]
    return [tool("sh"), "-c", " && ".join(shlex.join(step) for step in steps) + ' "$@"', "sh"]


def tool(name: str) -> str:
    """A program's path, for a step of the call's command."""
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")   # chroot: sbin, not on every PATH
    if path is None:
        raise FileNotFoundError(f"'{name}' is not on PATH (util-linux and coreutils are needed)")
    return path


def _installation(program: str) -> list[str]:
    """The directories a program outside the system directories runs from: the prefix above its bin/ (a venv's,
    with pyvenv.cfg) and, where it is a link, the prefix of the file it links to (the venv's base interpreter)."""
    prefixes = {str(Path(program).parent.resolve().parent), str(Path(program).resolve().parent.parent)}
    system = [os.path.realpath(top) for top in SYSTEM_DIRS]
    outside = sorted(p for p in prefixes if not any(Path(p).is_relative_to(top) for top in system))
    if "/" in outside:
        raise OSError(f"{program} is not installed under a directory of its own")
    return outside


def _read_only(dirs: list[str]) -> list[tuple[str, str]]:
    """What to remount read-only in the new root, where `dirs` are bound with the mounts under them: each of
    `dirs` (its binding has the flags of the mount that holds it) and each mount under one, with the flags of
    its own (nosuid, noexec, atime, ...) kept, as a user namespace may not clear them. Autofs triggers (looking
    would mount them) and mount points this process cannot reach (another user's FUSE mount: the code, with no
    more rights than this process, cannot reach it either) are left alone. Read afresh at every call."""
    mounts = _mounts()
    under = [point for point in mounts if any(Path(point).is_relative_to(d) for d in dirs) and os.path.exists(point)]
    holders = {point: max((m for m in mounts if Path(point).is_relative_to(m)), key=len) for point in (*dirs, *under)}
    return [(point, _read_only_options(mounts[m])) for point, m in holders.items() if "rw" in mounts[m]]


def _mounts() -> dict[str, list[str]]:
    """Mount points and their options (the top one where several are stacked), autofs triggers left out."""
    return {point: options for _, point, fstype, options, _ in mountinfo() if fstype != "autofs"}


def mountinfo() -> Iterator[tuple[str, str, str, list[str], list[str]]]:
    """Each mount's root in its filesystem, mount point, type, options, and its filesystem's own options."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, (fstype, _, super_options) = line.split(), line.split(" - ")[1].split()
            yield (_unescape(fields[3]), _unescape(fields[4]), fstype, fields[5].split(","),
                   super_options.split(","))


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _read_only_options(options: list[str]) -> str:
    return ",".join("ro" if option == "rw" else option for option in options)

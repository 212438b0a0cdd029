"""Run the workload correctly as PID 1 (like tini).

- The workload runs in its own process group, spawned with the forwarded
  signals at their default disposition and an empty signal mask.
- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to the
  supervisor are forwarded to the workload's process group.  SIGTERM is
  followed by SIGCONT (a stopped workload could not handle it) and starts
  the grace period: if the workload is still running when it ends, its
  process group is SIGKILLed.
- The workload's group gets the terminal's foreground when the supervisor
  has it, and gives it back at the end; when the workload stops on Ctrl-Z
  (or on using the terminal from the background) the supervisor stops too,
  terminal handed back, so the shell's job control sees it.
- Orphaned zombies are reaped: as PID 1, or (elsewhere) after
  prctl(PR_SET_CHILD_SUBREAPER), re-parented descendants are waited for.
- The exit code is the workload's, or 128+N when signal N killed it.
- The workload never outlives the supervisor's run(): whatever way run()
  ends, what is left of the workload's process group (and of the
  supervisor's descendants) is terminated, SIGKILL after the grace period.

The supervisor blocks the signals it handles (in the calling thread, which
must be the main thread, before any other thread exists: threads inherit
the mask) and takes them synchronously with sigtimedwait.  `gpuvisor run`
blocks them first of all (run.py), before it checks values and attaches
the region: as PID 1 a signal that arrives unblocked and without a handler
is discarded, while a blocked one stays pending until the loop forwards it.
The workload is spawned with an empty mask.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import time
from collections.abc import Callable

import psutil

log = logging.getLogger("gpuvisor.run")

FORWARDED: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
HANDLED = frozenset({*FORWARDED, signal.SIGCHLD})
# Reset to the default in the workload (Python ignores SIGPIPE and SIGXFSZ,
# and ignored dispositions survive exec).
RESET_IN_CHILD = frozenset(
    {*HANDLED, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTTOU, signal.SIGTTIN}
)
# The workload stopping on one of these is stopped by its terminal (Ctrl-Z,
# or using it from the background): the supervisor stops with it.
TTY_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
PR_SET_CHILD_SUBREAPER = 36
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
POLL_S = 0.5


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4)."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def exit_code(status: int) -> int:
    """waitpid status -> shell-style exit code (128+N for signal N)."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class SpawnError(OSError):
    """The command could not be started; .exit_code is 126 or 127."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


def spawn(argv: list[str], env: dict[str, str]) -> int:
    """Start argv in a new process group with clean signal state; return its PID."""
    if not argv[0]:
        # posix_spawnp refuses it (ValueError); a shell finds no such command.
        raise SpawnError(": command not found", EXIT_NOT_FOUND)
    try:
        return os.posix_spawnp(
            argv[0],
            argv,
            env,
            setpgroup=0,
            setsigmask=(),
            setsigdef=RESET_IN_CHILD,
        )
    except FileNotFoundError:
        raise SpawnError(f"{argv[0]}: command not found", EXIT_NOT_FOUND) from None
    except PermissionError:
        raise SpawnError(f"{argv[0]}: permission denied", EXIT_NOT_EXECUTABLE) from None
    except OSError as exc:
        raise SpawnError(f"{argv[0]}: {exc.strerror}", EXIT_NOT_EXECUTABLE) from None


def _set_foreground(pgid: int) -> None:
    """Make pgid the foreground group of the terminal on stdin (raises OSError)."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(0, pgid)
    finally:
        signal.signal(signal.SIGTTOU, old)


def _give_terminal(pgid: int) -> bool:
    """Make the workload's group the terminal's foreground group (as tini does).

    True when it did: the supervisor's group must get it back at the end."""
    try:
        if not os.isatty(0) or os.tcgetpgrp(0) != os.getpgrp():
            return False
        _set_foreground(pgid)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGCONT)  # in case it stopped on SIGTTIN before this
    return True


def _take_terminal_back() -> None:
    """Give the terminal's foreground back to the supervisor's own group: the
    one that ran `gpuvisor run` (a script, a shell without job control) reads
    from it next, and could not from the background."""
    with contextlib.suppress(OSError):
        _set_foreground(os.getpgrp())


def _not_zombie(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


class Pid1:
    """Spawn, forward, reap, exit; see the module docstring."""

    def __init__(self, argv: list[str], env: dict[str, str], grace: float) -> None:
        self.argv = argv
        self.env = env
        self.grace = grace
        self.pid = 0
        self.status: int | None = None
        self.reaped_orphans = 0
        self.gave_terminal = False
        self.tty_stop = 0  # the terminal stop signal the workload stopped on, if any
        # When the grace period a forwarded SIGTERM started ends (monotonic).
        self.kill_at: float | None = None

    def _reap(self) -> None:
        """Wait for every exited child; remember the workload's status."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if os.WIFSTOPPED(status):
                if pid == self.pid and os.WSTOPSIG(status) in TTY_STOPS:
                    self.tty_stop = os.WSTOPSIG(status)
                continue
            if pid == self.pid:
                self.status = status
            else:
                self.reaped_orphans += 1

    def _signal_group(self, sig: int) -> bool:
        """Send sig to the workload's group; False when the group is gone."""
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _kill_descendants(self, timeout: float) -> None:
        """SIGKILL every descendant, again and again until none is left.

        One pass is not enough: a process forking between the listing and
        its own SIGKILL leaves a child that the listing missed; re-parented
        to us (subreaper), it shows in the next pass.
        """
        end = time.monotonic() + timeout
        while True:
            self._reap()
            try:
                children = psutil.Process().children(recursive=True)
            except psutil.Error:
                return
            alive = [c for c in children if _not_zombie(c)]
            if not alive or time.monotonic() >= end:
                return
            for child in alive:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            time.sleep(0.005)

    def _cleanup(self, grace: float) -> None:
        """Terminate what is left of the workload: its group, then our descendants."""
        if not self.pid:
            return
        deadline = time.monotonic() + grace
        if self._signal_group(signal.SIGTERM):
            self._signal_group(signal.SIGCONT)
            while time.monotonic() < deadline:
                self._reap()
                if not self._signal_group(0):
                    break
                time.sleep(0.02)
            else:
                self._signal_group(signal.SIGKILL)
        self._kill_descendants(1.0)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            self._reap()
            if not self._signal_group(0):
                break
            time.sleep(0.01)
        self._reap()

    def run(self, started: Callable[[int], None] | None = None) -> int:
        """Spawn the workload, supervise it until it exits; return the exit code.

        started(pid) runs once the workload exists (start threads there:
        they inherit the blocked signal mask).  Raises SpawnError when the
        command cannot be started.
        """
        become_subreaper()
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        try:
            self.pid = spawn(self.argv, self.env)
            self.gave_terminal = _give_terminal(self.pid)
            if started is not None:
                started(self.pid)
            return self._loop()
        finally:
            self._cleanup(self._grace_left() if self.status is not None else 0.0)
            if self.gave_terminal:
                _take_terminal_back()

    def _grace_left(self) -> float:
        """The grace period for leftovers: what a SIGTERM's left of it, else all."""
        if self.kill_at is None:
            return self.grace
        return max(0.0, min(self.grace, self.kill_at - time.monotonic()))

    def _stop_with_workload(self) -> None:
        """The workload stopped on a terminal stop signal: stop as well.

        The shell that started `gpuvisor run` knows the supervisor, not the
        workload's group: on Ctrl-Z (SIGTSTP to the group holding the
        terminal) it would wait for good on a terminal nobody reads.  So the
        supervisor takes the terminal back and stops; the shell sees its job
        stopped.  Continued (fg, bg), it gives the terminal back to the
        workload when its own group has the foreground, and continues it.
        As PID 1 nothing stops it (SIGSTOP is ignored): the workload goes on
        at once, or stays stopped when it wants a terminal it cannot get.
        """
        sig, self.tty_stop = self.tty_stop, 0
        try:
            if psutil.Process(self.pid).status() != psutil.STATUS_STOPPED:
                return  # continued since (e.g. by _give_terminal's SIGCONT)
        except psutil.Error:
            return
        try:
            had_terminal = os.isatty(0) and os.tcgetpgrp(0) == self.pid
        except OSError:
            had_terminal = False
        if sig == signal.SIGTSTP and not had_terminal:
            return  # sent by someone, not typed on its terminal: leave it stopped
        if had_terminal:
            _take_terminal_back()
            self.gave_terminal = False
        if os.getpid() != 1:
            log.debug("workload stopped by signal %d: stopping too", sig)
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        self.gave_terminal = _give_terminal(self.pid) or self.gave_terminal
        if self.gave_terminal or os.getpid() != 1 or sig == signal.SIGTSTP:
            self._signal_group(signal.SIGCONT)

    def _loop(self) -> int:
        killed = False
        while True:
            self._reap()
            if self.status is not None:
                return exit_code(self.status)
            if self.tty_stop:
                self._stop_with_workload()
            now = time.monotonic()
            if self.kill_at is not None and not killed and now >= self.kill_at:
                log.warning(
                    "workload still running %.3gs after SIGTERM: sending SIGKILL", self.grace
                )
                self._signal_group(signal.SIGKILL)
                killed = True
            if self.kill_at is None or killed:
                timeout = POLL_S
            else:
                timeout = max(0.0, min(POLL_S, self.kill_at - now))
            info = signal.sigtimedwait(HANDLED, timeout)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            log.debug("forwarding signal %d to process group %d", info.si_signo, self.pid)
            self._signal_group(info.si_signo)
            if info.si_signo == signal.SIGTERM:
                # A stopped workload (SIGSTOP, a debugger, a SIGTSTP not from
                # its terminal) handles SIGTERM only once continued: continue
                # it, as systemd and a shell's kill do, or its grace period
                # would pass unused and end in SIGKILL.
                self._signal_group(signal.SIGCONT)
                if self.kill_at is None:
                    self.kill_at = time.monotonic() + self.grace

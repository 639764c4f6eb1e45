"""A virtual desktop for computer-use episodes: an Xvfb X server, the programs shown on it, screenshots and
input through xdotool.

Xvfb is started with `-displayfd`, so it picks a free display number itself and writes it to a pipe once it is
ready to take connections; that write is waited for with a deadline (`start_timeout_s`), and a server that exits or
stays silent is stopped and reported with the end of its log. `-fbdir` makes Xvfb keep its framebuffer in a
memory-mapped XWD file, which a screenshot reads and encodes as PNG (Pillow) without another X client. Input is
XTEST through xdotool, one process per action, each with a deadline. There is no window manager: windows place
themselves, and keyboard focus follows the pointer (X's default), so type into a field after clicking it.

Every process the desktop starts is stopped by `close()` (also when starting failed), and by the context manager.
"""

from __future__ import annotations

import io
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from posttrain.errors import RunError

DEFAULT_SCREEN = (640, 480)
"""Width and height of the desktop in pixels."""

XWD_HEADER = struct.Struct(">25I")
"""The 25 big-endian 32-bit fields that begin an XWD file (X11's XWDFileHeader)."""


class DesktopError(RunError):
    """The desktop could not start, or one of its programs did not answer in time: the message says which."""


def missing_programs() -> list[str]:
    """The programs a desktop needs (Xvfb, xdotool) that are not on PATH."""
    return [name for name in ("Xvfb", "xdotool") if shutil.which(name) is None]


class Desktop:
    """One Xvfb display with its own framebuffer file; see the module docstring.

    workdir: where the framebuffer and the server's log go (created if missing).
    xvfb: the X server program (a test passes one that never answers)."""

    def __init__(self, workdir: str | os.PathLike, *, width: int = DEFAULT_SCREEN[0],
                 height: int = DEFAULT_SCREEN[1], start_timeout_s: float = 10.0, action_timeout_s: float = 10.0,
                 xvfb: str = "Xvfb", xdotool: str = "xdotool"):
        if start_timeout_s <= 0 or action_timeout_s <= 0:
            raise ValueError("start_timeout_s and action_timeout_s must be positive")
        self.workdir = Path(workdir)
        self.width, self.height = width, height
        self.start_timeout_s, self.action_timeout_s = start_timeout_s, action_timeout_s
        self.xvfb, self.xdotool_program = xvfb, xdotool
        self.display: str | None = None
        self._server: subprocess.Popen | None = None
        self._programs: list[subprocess.Popen] = []
        self._fbdir: Path | None = None

    # ---- life cycle --------------------------------------------------------------------------------------------

    def start(self) -> Desktop:
        """Start Xvfb and wait (at most start_timeout_s) until it says its display; DesktopError otherwise."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._fbdir = Path(tempfile.mkdtemp(prefix="fb-", dir=self.workdir))
        log = self.workdir / "xvfb.log"
        read_end, write_end = os.pipe()
        try:
            with open(log, "wb") as log_file:
                self._server = subprocess.Popen(
                    [self.xvfb, "-displayfd", str(write_end), "-screen", "0", f"{self.width}x{self.height}x24",
                     "-fbdir", str(self._fbdir), "-nolisten", "tcp"],
                    pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    start_new_session=True)
            os.close(write_end)
            write_end = -1
            number = self._read_display(read_end, log)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        self.display = f":{number}"
        return self

    def _read_display(self, read_end: int, log: Path) -> int:
        deadline = time.monotonic() + self.start_timeout_s
        received = b""
        while not received.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DesktopError(f"Xvfb ({self.xvfb}) did not report its display within {self.start_timeout_s:g} s"
                                   f"{_log_tail(log)}")
            ready, _, _ = select.select([read_end], [], [], min(left, 0.1))
            if ready:
                chunk = os.read(read_end, 64)
                if not chunk:  # every writer closed the pipe: the server exited
                    code = self._server.wait(timeout=self.start_timeout_s)
                    raise DesktopError(f"Xvfb ({self.xvfb}) exited with code {code} before reporting its display"
                                       f"{_log_tail(log)}")
                received += chunk
        try:
            return int(received.strip())
        except ValueError:
            raise DesktopError(f"Xvfb ({self.xvfb}) reported {received!r} instead of a display number") from None

    def launch(self, argv: list[str], *, log_name: str) -> subprocess.Popen:
        """Start a program on this display (its output to WORKDIR/LOG_NAME); it is stopped by close()."""
        if self.display is None:
            raise RuntimeError("start the desktop before launching programs on it")
        environment = {**os.environ, "DISPLAY": self.display}
        with open(self.workdir / log_name, "wb") as log_file:
            program = subprocess.Popen(argv, env=environment, stdin=subprocess.DEVNULL, stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self._programs.append(program)
        return program

    def close(self) -> None:
        """Stop the programs, then the server (SIGTERM, SIGKILL after 5 s), and remove the framebuffer."""
        for process in [*self._programs, self._server]:
            if process is not None and process.poll() is None:
                _stop(process)
        self._programs, self._server, self.display = [], None, None
        if self._fbdir is not None:
            shutil.rmtree(self._fbdir, ignore_errors=True)
            self._fbdir = None

    def __enter__(self) -> Desktop:
        return self.start() if self.display is None else self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- observation and input -----------------------------------------------------------------------------------

    def screenshot(self) -> np.ndarray:
        """The screen as a [height, width, 3] uint8 RGB array, read from Xvfb's framebuffer file."""
        if self._fbdir is None:
            raise RuntimeError("the desktop is not started")
        return read_xwd((self._fbdir / "Xvfb_screen0").read_bytes())

    def screenshot_png(self) -> bytes:
        """The screen as PNG bytes."""
        buffer = io.BytesIO()
        Image.fromarray(self.screenshot()).save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    def xdotool(self, *arguments: str) -> None:
        """Run `xdotool ARGUMENTS` on this display; DesktopError when it fails or overruns action_timeout_s."""
        if self.display is None:
            raise RuntimeError("the desktop is not started")
        command = [self.xdotool_program, *arguments]
        try:
            result = subprocess.run(command, env={**os.environ, "DISPLAY": self.display}, capture_output=True,
                                    text=True, timeout=self.action_timeout_s)
        except subprocess.TimeoutExpired:
            raise DesktopError(f"xdotool {' '.join(arguments)} did not finish within {self.action_timeout_s:g} s") \
                from None
        if result.returncode != 0:
            raise DesktopError(f"xdotool {' '.join(arguments)} failed with code {result.returncode}: "
                               f"{result.stderr.strip()[-300:]}")


def read_xwd(data: bytes) -> np.ndarray:
    """The pixels of an XWD image (ZPixmap, 24 or 32 bits per pixel, true colour) as [height, width, 3] RGB."""
    if len(data) < XWD_HEADER.size:
        raise ValueError(f"an XWD file has a {XWD_HEADER.size}-byte header, got {len(data)} bytes")
    fields = XWD_HEADER.unpack_from(data)
    header_size, _, pixmap_format, _, width, height = fields[:6]
    byte_order, bits_per_pixel, bytes_per_line = fields[7], fields[11], fields[12]
    masks, ncolors = fields[14:17], fields[19]
    if pixmap_format != 2 or bits_per_pixel not in (24, 32):
        raise ValueError(f"only ZPixmap true-colour XWD images are read (format {pixmap_format}, "
                         f"{bits_per_pixel} bits per pixel given)")
    offset = header_size + 12 * ncolors
    size = bytes_per_line * height
    if len(data) < offset + size:
        raise ValueError(f"the XWD image is cut short: {len(data)} bytes, {offset + size} expected")
    rows = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset).reshape(height, bytes_per_line)
    step = bits_per_pixel // 8
    pixels = rows[:, :width * step].reshape(height, width, step)
    if step == 3:
        pixels = np.concatenate([pixels, np.zeros((height, width, 1), np.uint8)], axis=2)
    words = pixels.view("<u4" if byte_order == 0 else ">u4")[..., 0]
    channels = []
    for mask in masks:
        shift = (mask & -mask).bit_length() - 1
        channels.append(((words & mask) >> shift).astype(np.uint8))
    return np.stack(channels, axis=-1)


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


def _log_tail(log: Path) -> str:
    text = log.read_text(encoding="utf-8", errors="replace").strip() if log.exists() else ""
    return f"; its log ({log}) ends:\n{text[-800:]}" if text else ""


def python_program(script: Path, *arguments: str) -> list[str]:
    """argv that runs a Python file with this interpreter."""
    return [sys.executable, str(script), *arguments]

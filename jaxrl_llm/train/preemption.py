"""Save-and-stop on SIGTERM or SIGINT: preemptible VMs and spot slices send SIGTERM."""

import logging
import signal
import threading
import time

from jaxrl_llm.models import hosts

log = logging.getLogger(__name__)


class Preemption:
  """While active, the first SIGTERM or SIGINT asks the loop to save and stop after the
  current step; a second SIGINT interrupts at once. With `active=False` (a run without
  checkpoints: nothing to save) the signals keep their usual effect."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, active: bool = True):
    self.received = None
    self.at = None  # time.monotonic() when the first signal came
    self.active = active
    self._previous = {}

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    self.at = time.monotonic()
    log.warning("received %s: saving after the current step, then exiting.", self.received)

  def __enter__(self):
    if self.active and threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def seconds_since(self) -> float | None:
    """Seconds since this process got its signal (None when it got none: another process
    did)."""
    return None if self.at is None else time.monotonic() - self.at

  def requested(self) -> bool:
    """Whether any process got a signal (all processes must agree to stop together)."""
    return hosts.any_process(self.received is not None)

"""Leave a finished process without the interpreter's teardown.

A trainer rank or an engine server that has done its work and released what others wait for
(process groups destroyed, engines stopped, files closed) still spent seconds exiting: at the
demo scale 1.6 s in a rank (torch, Megatron and gloo module teardown) and 2.9 s in an engine
(vLLM's finalizers and a full garbage collection), every run, on the path a user and every
end-to-end test waits on (docs/LOG.md, session 16). :func:`exit_now` flushes what is buffered
and ends the process with its exit status. Only for ``__main__`` entry points: a function
called in-process (the tests call ``megarl.cli.main``) must return instead.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush logging and the standard streams, then ``os._exit(code)``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be written anyway
            pass
    os._exit(code)

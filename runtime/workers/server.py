"""Imported by the fork server of ``runtime.workers.start`` alone (its preload), never elsewhere.

A SIGTERM to the daemon's process group (an orchestrator's stop, ``kill -TERM -PGID``)
reaches the fork server too. Had it died, the exit codes of the workers it forked
would be lost (the daemon would read 255 for a rank that stopped cleanly), so the
server ignores it: it still exits with the daemon (its liveness pipe), and a forked
worker takes SIGTERM's default back (``workers.start``).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

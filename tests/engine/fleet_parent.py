"""A stand-in for trainer rank 0: starts a one-engine fleet exactly as the trainer does
(``Fleet.start_local``), writes what the test needs to ``--out``, then idles until it is
killed (SIGKILL: no shutdown, no cleanup) or stopped (SIGSTOP: heartbeats stop)."""

import argparse
import json
import time
from pathlib import Path

from megarl.fleet.fleet import Fleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lease-s", type=float, required=True)
    ap.add_argument("--heartbeat-s", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    fleet = Fleet.start_local(
        args.model, 1, 1, 0.25, out.parent / "logs", seed=0, start_timeout_s=300, lease_s=args.lease_s,
        heartbeat_s=args.heartbeat_s,
    )
    e = fleet.engines[0]
    assert e.proc is not None
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engine_pid": e.proc.pid, "staging": str(fleet.staging_dir), "address": e.address}))
    tmp.rename(out)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()

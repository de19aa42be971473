"""A real AWS credential_process for tests, steered through a JSON file:

    python credential_process.py CTL.json

CTL.json holds ``mode`` ("ok": print keys that expire ``ttl`` seconds from
now; "fail": exit 1 saying "the vault is sealed"; "hang": sleep a minute),
``key`` and ``secret``. Each run appends its mode to CTL.json.runs.
`profile_config` gives the lines of an AWS config file naming it.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time


def profile_config(profile: str, ctl: str) -> str:
    """An AWS config file's text: ``profile`` runs this script on ``ctl``."""
    return "[profile %s]\ncredential_process = %s %s %s\n" % (profile, sys.executable, os.path.abspath(__file__), ctl)


def main(ctl_path: str) -> int:
    with open(ctl_path) as f:
        ctl = json.load(f)
    with open(ctl_path + ".runs", "a") as runs:
        runs.write(ctl["mode"] + "\n")
    if ctl["mode"] == "fail":
        sys.stderr.write("the vault is sealed\n")
        return 1
    if ctl["mode"] == "hang":
        time.sleep(60)
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=ctl["ttl"])
    print(json.dumps({"Version": 1, "AccessKeyId": ctl["key"], "SecretAccessKey": ctl["secret"],
                      "Expiration": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

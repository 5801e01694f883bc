"""Prints the OUT_DIR of a package's build script, read from `cargo build
--message-format=json` on standard input: `cargo-out-dir.py NAME`.

Cargo writes a package id in two forms: `path+file:///.../dir#NAME@1.0.0`,
and `path+file:///.../NAME#1.0.0` when the folder is named as the package
(a clone's default name); both name the package NAME.
"""

import json
import sys


def package_name(package_id: str) -> str:
    url, _, fragment = package_id.rpartition("#")
    if "@" in fragment:
        return fragment.split("@", 1)[0]
    return url.rstrip("/").rsplit("/", 1)[-1]


def main() -> None:
    want = sys.argv[1]
    for line in sys.stdin:
        m = json.loads(line)
        if m.get("reason") == "build-script-executed" and package_name(m["package_id"]) == want:
            print(m["out_dir"])


if __name__ == "__main__":
    main()

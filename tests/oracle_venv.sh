# Sourced by the engine oracles' make_env.sh. build_venv VENV REQUIREMENTS PACKAGE builds an engine's own virtualenv:
# the CPU torch and the packages of REQUIREMENTS its CPU load path imports, then PACKAGE without its dependency tree
# (its torch pin has no CPU build here); rebuilt only when REQUIREMENTS changes (its hash is VENV's stamp, so it names
# PACKAGE's pin too, in a comment). derive_venv BASE VENV STAMP PACKAGE makes VENV a hard-linked copy of BASE with
# PACKAGE reinstalled (pip unlinks, never rewrites, files).
#
# Both build in a folder beside VENV (VENV.building-PID) and rename it over VENV only once it is complete: a failed or
# interrupted build leaves the previous VENV as it was (its old stamp, so the next run builds again) and no half-built
# venv under VENV's name. `python -m venv` and pip write the folder's path into the scripts' shebangs, the activate
# scripts and pyvenv.cfg (a derived copy: BASE's path): those are rewritten to VENV before the rename, each as a new
# file (sed -i), so that no file hard-linked with BASE changes.
venv_stamp() { sha256sum < "$1" | cut -d' ' -f1; }
venv_fresh() { [ -f "$1/.requirements.sha256" ] && [ "$(cat "$1/.requirements.sha256")" = "$2" ]; }

_venv_staging() {  # a new staging folder beside VENV; those that interrupted runs left are removed first
    local venv=$1 old
    for old in "$venv".building-*; do [ -e "$old" ] && rm -rf "$old"; done
    echo "$venv.building-$$"
}

_venv_relocate() {  # folder from to: the path `from` that pip and venv wrote (text files of bin/, pyvenv.cfg), where
    # a path ends (before /, a quote, a blank or the line's end: not /x/.venv-vllm inside /x/.venv-vllm-0.34), says `to`
    local dir=$1 from=$2 to=$3 file pattern d=$'\001'  # sed's delimiter: a byte no path holds
    pattern=$(printf '%s' "$from" | sed 's/[][\.*^$]/\\&/g')
    { grep -rlIF -- "$from" "$dir/bin" "$dir/pyvenv.cfg" 2>/dev/null || true; } | while IFS= read -r file; do
        [ -L "$file" ] || sed -i "s$d$pattern\\([/'\" ]\\|\$\\)$d$to\\1${d}g" "$file"
    done
}

_venv_install() {  # staging venv: rename over venv (the old one out of the way first, removed after)
    local staging=$1 venv=$2 old="$2.old-$$"
    if [ -e "$venv" ]; then mv "$venv" "$old" || return 1; fi
    if ! mv "$staging" "$venv"; then
        [ -e "$old" ] && mv "$old" "$venv"
        return 1
    fi
    rm -rf "$old"
}

_venv_fail() {  # staging message: remove the staging folder, say why, fail
    rm -rf "$1"
    echo "oracle_venv.sh: $2 (the previous venv, if any, is left as it was)" >&2
    return 1
}

build_venv() {  # VENV is made absolute and canonical first: `python -m venv` writes its folder's canonical path,
    # which is what _venv_relocate looks for (a VENV given as tests/sglang/../../.venv-sglang is found nowhere)
    local venv requirements=$2 package=$3 want staging
    venv=$(realpath -m "$1")
    want=$(venv_stamp "$requirements")
    if venv_fresh "$venv" "$want"; then return 0; fi
    staging=$(_venv_staging "$venv")
    python -m venv "$staging" || { _venv_fail "$staging" "python -m venv $staging failed"; return 1; }
    "$staging/bin/python" -m pip install -q torch==2.13.0 -r "$requirements" \
        || { _venv_fail "$staging" "pip install -r $requirements failed"; return 1; }
    "$staging/bin/python" -m pip install -q --no-deps "$package" \
        || { _venv_fail "$staging" "pip install $package failed"; return 1; }
    echo "$want" > "$staging/.requirements.sha256"
    _venv_relocate "$staging" "$staging" "$venv"
    _venv_install "$staging" "$venv" || { _venv_fail "$staging" "could not rename $staging to $venv"; return 1; }
}

derive_venv() {  # base venv stamp package; returns 2 where base cannot be hard-linked (another file system)
    local base venv want=$3 package=$4 staging
    base=$(realpath -m "$1") venv=$(realpath -m "$2")
    if venv_fresh "$venv" "$want"; then return 0; fi
    staging=$(_venv_staging "$venv")
    cp -al "$base" "$staging" 2>/dev/null || { rm -rf "$staging"; return 2; }
    rm -f "$staging/.requirements.sha256"
    "$staging/bin/python" -m pip install -q --no-deps --force-reinstall "$package" \
        || { _venv_fail "$staging" "pip install $package failed"; return 1; }
    echo "$want" > "$staging/.requirements.sha256"
    _venv_relocate "$staging" "$base" "$venv"
    _venv_relocate "$staging" "$staging" "$venv"
    _venv_install "$staging" "$venv" || { _venv_fail "$staging" "could not rename $staging to $venv"; return 1; }
}

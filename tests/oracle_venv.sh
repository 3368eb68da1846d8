# Sourced by the engine oracles' make_env.sh. build_venv VENV REQUIREMENTS PACKAGE builds an engine's own virtualenv:
# the CPU torch and the packages of REQUIREMENTS its CPU load path imports, then PACKAGE without its dependency tree
# (its torch pin has no CPU build here); rebuilt only when REQUIREMENTS changes (its hash is VENV's stamp, so it names
# PACKAGE's pin too, in a comment).
build_venv() {
    local venv=$1 requirements=$2 package=$3 stamp want
    stamp="$venv/.requirements.sha256"
    want=$(sha256sum < "$requirements" | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    rm -rf "$venv"
    python -m venv "$venv"
    "$venv/bin/python" -m pip install -q torch==2.13.0 -r "$requirements"
    "$venv/bin/python" -m pip install -q --no-deps "$package"
    echo "$want" > "$stamp"
}

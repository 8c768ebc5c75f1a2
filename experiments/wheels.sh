# Sourced by the GPU drivers here. `install_wheels [MORE.whl ...]` installs the wheels
# the device machine lacks (ml_collections, absl, tensorboardX, pyyaml: `wheels/` beside
# the tree, and any given) into $SITE (/tmp/site), unless SKIP_INSTALL=1 or there is
# no wheels/ folder.
#
#   source "$(dirname "$0")/wheels.sh"
#   install_wheels || exit 1
SITE=${SITE:-/tmp/site}

install_wheels() {
  if [[ -d wheels && ${SKIP_INSTALL:-0} != 1 ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" wheels/*.whl "$@"
  fi
}

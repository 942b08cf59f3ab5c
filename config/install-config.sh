#!/bin/sh
# meson install: the example config goes in as ringd.yaml only where there is none yet (an
# operator's hosts list is never overwritten), and always as ringd.yaml.example beside it.
# Usage (meson.add_install_script): install-config.sh SOURCE DIR
set -eu
src=$1
dir=${DESTDIR:-}$2
mkdir -p "$dir"
install -m 0644 "$src" "$dir/ringd.yaml.example"
if [ -e "$dir/ringd.yaml" ]; then
    echo "ringd: keeping $dir/ringd.yaml (the example of this version is ringd.yaml.example)"
else
    install -m 0644 "$src" "$dir/ringd.yaml"
fi

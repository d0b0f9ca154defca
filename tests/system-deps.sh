#!/bin/sh
# The system packages the tests need beyond the build's own (make's system-deps), installed with apt as root:
#   sshd and tmux (SSH nodes, the terminal dashboard), qemu-user with binfmt and debootstrap (the emulated arm64
#   node and its Debian root), the aarch64 cross compiler (its worker is cross-built here), and the Vulkan build
#   tools with Mesa's software Vulkan (lavapipe) for the Vulkan node. On Debian 12 Mesa comes from
#   bookworm-backports: 22.3's lavapipe crashes the worker mid-compute in 20-50 % of runs, 25.0's did not.
#   Chromium and its chromedriver: the web dashboard's tests drive a real browser (Selenium, tests/browser.py).
# Anything missing without root or apt is named, and the tests that need it skip (CI fails them instead).
set -eu
packages="openssh-server openssh-client tmux procps qemu-user-static binfmt-support debootstrap
g++-aarch64-linux-gnu glslc spirv-headers libvulkan-dev vulkan-tools mesa-vulkan-drivers chromium chromium-driver"
. /etc/os-release
codename=${VERSION_CODENAME:-}

missing=
for package in $packages; do
    dpkg-query -W -f '${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing="$missing $package"
done
old_mesa=
if [ "$codename" = bookworm ] && ! dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q bpo; then
    old_mesa=1
fi
binfmt_off=
[ -f /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || binfmt_off=1

if [ -z "$missing" ] && [ -z "$old_mesa" ] && [ -z "$binfmt_off" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "test dependencies missing:${missing:-}${old_mesa:+ mesa-vulkan-drivers from $codename-backports}${binfmt_off:+ binfmt for aarch64}"
    echo "  (as root on Debian/Ubuntu, \`make test-deps\` installs them; the tests that need them skip)"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if [ -n "$old_mesa" ] && ! apt-cache policy 2>/dev/null | grep -q "$codename-backports"; then
    # The backports suite of the archive this machine's apt already uses.
    uri=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n 1)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "'"$codename"'" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    [ -n "$uri" ] || { echo "no Debian archive in /etc/apt sources to take $codename-backports from"; exit 1; }
    printf 'Types: deb\nURIs: %s\nSuites: %s-backports\nComponents: main\nSigned-By: %s\n' "$uri" "$codename" \
        /usr/share/keyrings/debian-archive-keyring.gpg > /etc/apt/sources.list.d/ggml-cluster-backports.sources
fi
echo "installing test dependencies:${missing:-}${old_mesa:+ (Mesa from $codename-backports)}"
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq $missing >/dev/null
if [ -n "$old_mesa" ]; then
    apt-get install -y -qq -t "$codename-backports" mesa-vulkan-drivers >/dev/null
fi
# binfmt_misc is not mounted in every container; qemu-user-static registers aarch64 with the F flag.
[ -f /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64

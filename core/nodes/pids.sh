# Process identity for the pid files on a node, in POSIX sh (dash, bash, macOS/BSD sh). A pid file holds
# "PID START"; a pid is signalled only while it still names that process, as after a reboot (or a long
# uptime) the same number can belong to anybody's process. Sourced before every command that reads a pid
# file, and put at the top of supervise.sh when it is installed (state.py is the Python side of this).

# alive PID: running and not a zombie (a killed process whose parent has not reaped it still answers
# kill -0; where PID 1 does not reap, that lasts forever).
alive() { _s=$(ps -o stat= -p "$1" 2>/dev/null) && [ -n "$_s" ] && case "$_s" in Z*) false;; esac; }

# started PID: when PID started, as one word: on Linux the boot id and the start time in clock ticks since
# boot (field 22 of /proc/PID/stat), elsewhere ps's lstart (to the second).
started() {
    if [ -r /proc/sys/kernel/random/boot_id ] && [ -d /proc/self ]; then
        _s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
        _s=${_s##*") "}  # after the command name, which may hold spaces and parentheses: field 3 on
        set -- $_s
        [ -n "${20:-}" ] && printf '%s:%s\n' "$(cat /proc/sys/kernel/random/boot_id)" "${20}"
    else
        _s=$(ps -o lstart= -p "$1" 2>/dev/null | tr -d ' ') && [ -n "$_s" ] && printf '%s\n' "$_s"
    fi
}

# record PID: the line a pid file holds.
record() { printf '%s %s\n' "$1" "$(started "$1")"; }

# command_of PID: its command line, arguments joined by spaces (whole, where /proc has it).
command_of() {
    if [ -r "/proc/$1/cmdline" ]; then tr '\0' ' ' < "/proc/$1/cmdline"; else ps -ww -o args= -p "$1"; fi 2>/dev/null
}

# ours FILE MARKER: prints "PID START" when FILE names a live process that started when FILE says (a file
# of the previous version holds the pid alone) and whose command line, spaces around it, holds MARKER.
ours() {
    _p= _w=
    read -r _p _w _ < "$1" 2>/dev/null  # fails without a final newline, yet sets the variables
    case "$_p" in ''|*[!0-9]*) return 1;; esac
    alive "$_p" && _n=$(started "$_p") || return 1
    [ -z "$_w" ] || [ "$_w" = "$_n" ] || return 1
    case " $(command_of "$_p") " in *"$2"*) printf '%s %s\n' "$_p" "$_n";; *) return 1;; esac
}

# send SIGNAL "PID START": signal that process if it still runs (another one may have its pid by now).
send() {
    set -- "$1" $2
    [ -n "${3:-}" ] && [ "$(started "$2")" = "$3" ] && kill "-$1" "$2" 2>/dev/null
}

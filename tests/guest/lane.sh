#!/usr/bin/env bash
# The guest lane: the daemon on the kind of node people run (systemd as PID 1, cgroup v2).
# Run inside the guest, from the checkout, by `scripts/guest --lane`, which builds
# critest's images on the host first when a critest step is asked for.
#
#   unit              the daemon installed by scripts/install as its systemd unit
#                     (Type=notify, Delegate=yes): containers start, in a cgroup namespace
#                     of their own, with their limits and stats (tests/guest/test_unit.py);
#                     an OOM-killed container reported OOMKilled under each cgroup driver
#                     (tests/guest/test_oom.py); and the tests elsewhere that need cgroup
#                     v2 or systemd as PID 1 and skip on a v1 host: the cgroup v2 layout
#                     on a real hierarchy (tests/unit/runtime/test_cgroup_layout.py), pods
#                     under systemd's driver with runc and with crun, in scopes that go
#                     with them (tests/integration/test_cri_cgroup_driver.py)
#   critest-systemd   the conformance gate under runc, systemd's cgroup driver
#   critest-cgroupfs  the same with the cgroupfs driver (tests/conformance.py)
#   kubelet           the static-pod scenario, kubelet with --fail-cgroupv1=true and the
#                     daemon's cgroup driver, systemd's (tests/scenarios/
#                     test_kubelet_static_pods.py), with kubelet's default PLEG; its
#                     EventedPLEG variant (alpha, off by default) is left out here: after
#                     kubelet restarts, its pod workers sync before its first relist has
#                     filled its pod cache, find no sandbox and make every pod anew
#                     (kubernetes/kubernetes#123087, #124704), which the emulated guest's
#                     slow relist makes happen each time
#   density           benchmarks/density.py under each cgroup driver, cgroupfs's then
#                     systemd's, with the ratio of systemd's start and removal times to
#                     cgroupfs's; GUEST_DENSITY_ARGS (default "--pods 20 --workloads plain
#                     --cgroup-driver both --steady 30", about 4 minutes) are its
#                     arguments. It prints figures and asserts none: it fails only if
#                     the benchmark cannot run
#   kubelet-restart   `systemctl restart cri-shim` under a real kubelet churning static
#                     pods, with the units scripts/install writes: with socket activation
#                     kubelet's log reports no CRI call unavailable, without it it does
#                     (tests/guest/test_kubelet_restart.py, marked slow: not in `unit`;
#                     about 5 minutes: `scripts/guest --lane kubelet-restart leftovers`);
#                     and a stop of the unit takes its socket down, a restart keeps it,
#                     and a stop does not wait for a call in flight as a restart does
#                     (tests/guest/test_socket_activation.py, the tests marked slow)
#   node-e2e          Kubernetes' node conformance suite (tests/node_e2e.py) against the
#                     daemon installed as its unit (socket-activated, `cgroup_manager`
#                     auto: systemd's), kubelet with cgroupDriver systemd, started by the
#                     suite through systemd-run: the specs that exercise cgroups
#                     (CGROUP_SUBSET there, by name), GUEST_NODE_E2E_NODES (default 1)
#                     at a time: at 2 the emulated kube-apiserver timed out its own
#                     requests. About 2 minutes a spec: not for the default lane
#   node-e2e-serial   the suite's Serial spec that stops and starts the runtime through
#                     its systemd unit (MirrorPodWithGracePeriod ... the container
#                     runtime is temporarily down), with the unit as scripts/install
#                     writes it; node-e2e-serial-no-socket the same, installed with
#                     --no-socket-activation. The first passes (README); the second
#                     does not under emulation: this suite (v1.28.4) sees a unit's job
#                     end only within 10 s, and a daemon binding its own socket says
#                     READY=1 only once it serves; the runner ends the run at ginkgo's
#                     20-minute bound for a Serial spec (SERIAL_TIMEOUT)
#   leftovers         nothing of the daemon's left on the node: no unit or scope, cgroup or
#                     mount (tests/guest/leftovers.py); last, after the others
#
# Each step runs whatever the previous ones did; the lane fails if any step failed, and
# says how long each took. GUEST_LANE_STEPS (default "unit critest-systemd kubelet
# leftovers", what CI runs) chooses the steps. The density step runs when
# asked for: `scripts/guest --lane density leftovers` (a --timeout of more than 1800 s for
# many more pods).
set -uo pipefail
cd "$(dirname "$0")/../.."
export CRI_SHIM_GUEST=1 PYTHONDONTWRITEBYTECODE=1
# Under emulation a daemon takes 20-60 s to import, restore and serve (tests/harness.py).
export CRI_SHIM_TEST_START_TIMEOUT=240
# And a sandbox takes 10-20 s to make: the scenarios' waits are scaled (tests/waiting.py).
export CRI_SHIM_TEST_TIME_SCALE=4
# The guest has no python3 of its own: the checkout's environment is the one on PATH, for
# the daemon's children that are Python scripts (the slow-cni test plugin's
# `#!/usr/bin/env python3`).
export PATH="$PWD/.venv/bin:$PATH"

echo "lane: $(uname -r), cgroup $(stat -fc %T /sys/fs/cgroup), $(systemctl --version | head -1)"
failed=()
step() {
    local name=$1 started=$SECONDS status=0
    shift
    echo "lane: --- $name"
    "$@" || status=$?
    echo "lane: --- $name: exit $status in $((SECONDS - started)) s"
    ((status == 0)) || failed+=("$name")
}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
for name in ${GUEST_LANE_STEPS:-unit critest-systemd kubelet leftovers}; do
    case "$name" in
        unit) step unit "${pytest[@]}" --durations=0 --durations-min=5 -m "not slow" tests/guest \
            tests/unit/runtime/test_cgroup_layout.py tests/integration/test_cri_cgroup_driver.py ;;
        critest-systemd | critest-cgroupfs)
            step "$name" .venv/bin/python -m tests.conformance --cgroup-manager "${name#critest-}" ;;
        # Short tracebacks: the failing line and its message, not the scenario's source.
        kubelet) step kubelet "${pytest[@]}" --tb=short \
            "tests/scenarios/test_kubelet_static_pods.py::test_kubelet_runs_static_pods[generic-pleg]" ;;
        kubelet-restart) step kubelet-restart "${pytest[@]}" -s --durations=0 \
            tests/guest/test_kubelet_restart.py \
            tests/guest/test_socket_activation.py -m slow ;;
        density)
            # Its daemons load their modules' bytecode, as an installed daemon does,
            # rather than compiling them at each start (which would weigh on their PSS).
            # shellcheck disable=SC2086 # the arguments are words
            step density env -u PYTHONDONTWRITEBYTECODE .venv/bin/python benchmarks/density.py \
                ${GUEST_DENSITY_ARGS:---pods 20 --workloads plain --cgroup-driver both --steady 30} ;;
        node-e2e) step node-e2e .venv/bin/python -m tests.node_e2e --as-installed-unit \
            --cgroup-driver systemd --subset cgroup --nodes "${GUEST_NODE_E2E_NODES:-1}" ;;
        node-e2e-serial | node-e2e-serial-no-socket)
            unit=(--as-installed-unit)
            [ "$name" = node-e2e-serial ] || unit+=(--no-socket-activation)
            # The spec reads kubelet's metrics at localhost:10255.
            step "$name" .venv/bin/python -m tests.node_e2e "${unit[@]}" --cgroup-driver systemd \
                --serial --focus MirrorPodWithGracePeriod --kubelet-address 0.0.0.0 ;;
        leftovers) step leftovers .venv/bin/python -m tests.guest.leftovers ;;
        *) echo "lane: unknown step $name"; failed+=("$name") ;;
    esac
done
if ((${#failed[@]})); then
    echo "lane: FAILED: ${failed[*]}"
    exit 1
fi
echo "lane: passed"

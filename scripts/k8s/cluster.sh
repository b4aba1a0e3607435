#!/usr/bin/env bash
# A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler; all on 127.0.0.1, free ports, so several can run at once) for tests.
# No kubelet: tests/kubernetes/testkubelet.py stands in for the nodes.
#
#   scripts/k8s/cluster.sh start DIR   # ~5 s when the binaries are cached
#   scripts/k8s/cluster.sh stop DIR    # idempotent; kills what start started
#
# start writes into DIR:
#   env         shell-sourceable (`set -a; . DIR/env; set +a`), one KEY=VALUE a line:
#               KUBE_SERVER=https://127.0.0.1:PORT  KUBE_APISERVER_PORT=PORT
#               KUBE_TOKEN=<admin token, group system:masters>  KUBE_CA=DIR/pki/ca.crt
#               KUBECONFIG=DIR/kubeconfig  KUBECTL=<cached kubectl>  KUBE_BIN_DIR=<cache bin>
#               ETCD_ENDPOINT=http://127.0.0.1:PORT  KUBE_CLUSTER_DIR=DIR
#   kubeconfig  admin kubeconfig (CA-verified TLS, bearer token)
#   pki/        ca.crt ca.key apiserver.crt apiserver.key sa.key sa.pub
#   tokens.csv  static tokens (admin; controller-manager and scheduler identities)
#   pids        "NAME PID" per daemon;  logs/NAME.log per daemon;  etcd/ data
# start returns once /readyz is 200, the `default` ServiceAccount and the
# kube-root-ca.crt ConfigMap exist in namespace default.
#
# Test settings: node lifecycle is fast (node-monitor-grace-period 10 s, not-ready and
# unreachable tolerations 10 s, eviction rate 1/s), etcd runs with --unsafe-no-fsync.
# RBAC is enforced (--authorization-mode=Node,RBAC), the ServiceAccount admission
# plugin is on, no kube-proxy: the service IP range 10.0.0.0/24 routes nowhere.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
DAEMONS=(kube-scheduler kube-controller-manager kube-apiserver etcd)  # stop order

log() { echo "ballast k8s cluster: $*" >&2; }
die() { echo "ballast k8s cluster: ERROR: $*" >&2; exit 1; }
usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

[ $# -eq 2 ] || usage
CMD="$1"
[ "$CMD" != start ] || mkdir -p "$2" || die "cannot create $2"
if [ -d "$2" ]; then DIR="$(cd "$2" && pwd)"; else DIR="$2"; fi

# ---- process helpers
# pid_is NAME PID: PID is alive and is our NAME daemon (guards against recycled pids).
pid_is() {
  local exe
  [ -n "$2" ] && kill -0 "$2" 2>/dev/null || return 1
  exe="$(tr '\0' ' ' <"/proc/$2/cmdline" 2>/dev/null | cut -d' ' -f1)" || return 1
  [ "$(basename "$exe")" = "$1" ]
}
pids_of_file() {  # prints "NAME PID" for live daemons listed in DIR/pids
  [ -f "$DIR/pids" ] || return 0
  local name pid
  while read -r name pid; do
    pid_is "$name" "$pid" && echo "$name $pid"
  done <"$DIR/pids"
  return 0
}

stop_cluster() {
  local t0 live name pid i
  t0="$(now)"
  live="$(pids_of_file)"
  if [ -n "$live" ]; then
    for name in "${DAEMONS[@]}"; do
      while read -r n pid; do [ "$n" = "$name" ] && kill -TERM "$pid" 2>/dev/null || true; done <<<"$live"
    done
    for i in $(seq 1 50); do  # up to 5 s for a clean exit
      [ -z "$(pids_of_file)" ] && break
      sleep 0.1
    done
    live="$(pids_of_file)"
    if [ -n "$live" ]; then
      log "SIGKILL: $(echo $live)"
      while read -r n pid; do kill -KILL "$pid" 2>/dev/null || true; done <<<"$live"
      for i in $(seq 1 50); do
        [ -z "$(pids_of_file)" ] && break
        sleep 0.1
      done
      [ -z "$(pids_of_file)" ] || die "processes still alive after SIGKILL: $(pids_of_file | tr '\n' ' ')"
    fi
  fi
  rm -rf "$DIR/etcd"
  rm -f "$DIR/pids"
  log "stopped in $(elapsed "$t0") s ($DIR)"
}

# ---- start helpers
free_ports() {  # N distinct free loopback ports
  "$PY" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

launch() {  # NAME ARGS...: start a daemon in the background, log to logs/NAME.log
  local name="$1"; shift
  (
    # Close inherited descriptors beyond stderr: a caller's pipe held open by a daemon
    # would never see EOF.
    for fd in /proc/$BASHPID/fd/*; do
      fd="${fd##*/}"
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-" 2>/dev/null
    done
    exec "$BIN/$name" "$@"
  ) </dev/null >>"$DIR/logs/$name.log" 2>&1 &
  LAUNCHED=$!
  echo "$name $LAUNCHED" >>"$DIR/pids"
}

fail_start() {
  local name
  log "start failed: $*"
  for name in "${DAEMONS[@]}"; do
    [ -f "$DIR/logs/$name.log" ] || continue
    echo "---- last lines of $DIR/logs/$name.log" >&2
    tail -n 15 "$DIR/logs/$name.log" >&2
  done
  stop_cluster || true
  exit 1
}

bound_fail() {  # LOGFILE: did the daemon die because a port was taken?
  grep -qiE 'address already in use|bind: address' "$1"
}

api() {  # PATH: curl the apiserver as admin; prints the HTTP status
  curl -sS -o /dev/null -w '%{http_code}' --max-time 2 --cacert "$DIR/pki/ca.crt" \
    -H "Authorization: Bearer $ADMIN_TOKEN" "https://127.0.0.1:$API_PORT$1" 2>/dev/null || true
}

make_pki() {
  local p="$DIR/pki"
  mkdir -p "$p"
  if [ -f "$p/ca.crt" ] && [ -f "$p/apiserver.crt" ] && [ -f "$p/sa.key" ]; then return 0; fi
  (
    set -e
    cd "$p"
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout ca.key -out ca.crt \
      -subj "/CN=ballast-test-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
    openssl req -newkey rsa:2048 -nodes -sha256 -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
    cat >apiserver.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.0.0.1
EOF
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -sha256 \
      -extfile apiserver.ext -out apiserver.crt
    openssl genrsa -out sa.key 2048
    openssl rsa -in sa.key -pubout -out sa.pub
    rm -f apiserver.csr ca.srl
    chmod 600 ca.key apiserver.key sa.key
  ) >"$DIR/logs/pki.log" 2>&1 || { cat "$DIR/logs/pki.log" >&2; die "openssl failed making $p"; }
}

write_kubeconfig() {  # FILE TOKEN USER
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ballast-test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $DIR/pki/ca.crt
users:
- name: $3
  user:
    token: $2
contexts:
- name: ballast-test
  context:
    cluster: ballast-test
    user: $3
    namespace: default
current-context: ballast-test
EOF
  chmod 600 "$1"
}

envline() {  # KEY VALUE: unquoted when safe, single-quoted otherwise
  if [[ "$2" =~ ^[A-Za-z0-9_./:@+,=-]*$ ]]; then echo "$1=$2"
  else printf "%s='%s'\n" "$1" "${2//\'/\'\\\'\'}"; fi
}

start_cluster() {
  local t0 try i ports
  t0="$(now)"
  [ -z "$(pids_of_file)" ] || die "a cluster is already running in $DIR (run: $0 stop $DIR)"
  BIN="$("$HERE/build-control-plane.sh")" || die "building the control plane binaries failed"
  command -v openssl >/dev/null || die "openssl is needed (apt-get install openssl)"
  command -v curl >/dev/null || die "curl is needed (apt-get install curl)"
  rm -rf "$DIR/etcd" "$DIR/pids" "$DIR/logs"
  mkdir -p "$DIR/logs"
  make_pki
  rand() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }
  ADMIN_TOKEN="$(rand)"; local cm_token sched_token
  cm_token="$(rand)"; sched_token="$(rand)"
  cat >"$DIR/tokens.csv" <<EOF
$ADMIN_TOKEN,admin,admin-uid,"system:masters"
$cm_token,system:kube-controller-manager,kcm-uid,"system:masters"
$sched_token,system:kube-scheduler,ksched-uid,"system:masters"
EOF
  chmod 600 "$DIR/tokens.csv"

  # etcd (retry with other ports if one was taken between picking and binding)
  for try in 1 2 3 4 5; do
    read -r ETCD_PORT ETCD_PEER_PORT <<<"$(free_ports 2)"
    rm -rf "$DIR/etcd"
    launch etcd --name=ballast --data-dir="$DIR/etcd" --unsafe-no-fsync --log-level=warn \
      --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
      --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-cluster="ballast=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state=new
    local etcd_pid=$LAUNCHED ok=
    for i in $(seq 1 200); do
      if [ "$(curl -s --max-time 1 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null)" = '{"health":"true","reason":""}' ]; then ok=1; break; fi
      kill -0 "$etcd_pid" 2>/dev/null || break
      sleep 0.05
    done
    [ -n "$ok" ] && break
    kill -0 "$etcd_pid" 2>/dev/null && fail_start "etcd not healthy after 10 s"
    bound_fail "$DIR/logs/etcd.log" || fail_start "etcd exited"
    log "etcd port taken, retrying with other ports"
  done
  [ -n "$ok" ] || fail_start "etcd: no free ports after 5 tries"

  # kube-apiserver
  for try in 1 2 3 4 5; do
    API_PORT="$(free_ports 1)"
    launch kube-apiserver \
      --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
      --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
      --tls-cert-file="$DIR/pki/apiserver.crt" --tls-private-key-file="$DIR/pki/apiserver.key" \
      --client-ca-file="$DIR/pki/ca.crt" \
      --token-auth-file="$DIR/tokens.csv" \
      --authorization-mode=Node,RBAC \
      --service-account-key-file="$DIR/pki/sa.pub" \
      --service-account-signing-key-file="$DIR/pki/sa.key" \
      --service-account-issuer=https://kubernetes.default.svc.cluster.local \
      --service-cluster-ip-range=10.0.0.0/24 \
      --endpoint-reconciler-type=none \
      --allow-privileged=true \
      --default-not-ready-toleration-seconds=10 \
      --default-unreachable-toleration-seconds=10 \
      --profiling=false \
      --cert-dir="$DIR/pki/apiserver-certdir"
    local api_pid=$LAUNCHED ok=
    for i in $(seq 1 600); do  # 30 s
      if [ "$(api /readyz)" = 200 ]; then ok=1; break; fi
      kill -0 "$api_pid" 2>/dev/null || break
      sleep 0.05
    done
    [ -n "$ok" ] && break
    kill -0 "$api_pid" 2>/dev/null && fail_start "kube-apiserver /readyz not 200 after 30 s"
    bound_fail "$DIR/logs/kube-apiserver.log" || fail_start "kube-apiserver exited"
    log "apiserver port taken, retrying with another port"
  done
  [ -n "$ok" ] || fail_start "kube-apiserver: no free port after 5 tries"
  local t_api; t_api="$(elapsed "$t0")"

  write_kubeconfig "$DIR/kubeconfig" "$ADMIN_TOKEN" admin
  write_kubeconfig "$DIR/kubeconfig-controller-manager" "$cm_token" system:kube-controller-manager
  write_kubeconfig "$DIR/kubeconfig-scheduler" "$sched_token" system:kube-scheduler

  # Controller-manager and scheduler serve no port (--secure-port=0): nothing to collide.
  launch kube-controller-manager \
    --kubeconfig="$DIR/kubeconfig-controller-manager" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=0 \
    --authentication-skip-lookup=true \
    --service-account-private-key-file="$DIR/pki/sa.key" \
    --root-ca-file="$DIR/pki/ca.crt" \
    --controllers='*,-nodeipam,-cloud-node-lifecycle,-service,-route,-persistentvolume-binder,-attachdetach' \
    --node-monitor-grace-period=10s --node-monitor-period=2s \
    --node-eviction-rate=1 --secondary-node-eviction-rate=1 \
    --kube-api-qps=300 --kube-api-burst=600 --concurrent-replicaset-syncs=10 \
    --profiling=false
  launch kube-scheduler \
    --kubeconfig="$DIR/kubeconfig-scheduler" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=0 \
    --authentication-skip-lookup=true --profiling=false \
    --kube-api-qps=300 --kube-api-burst=600

  {
    envline KUBE_SERVER "https://127.0.0.1:$API_PORT"
    envline KUBE_APISERVER_PORT "$API_PORT"
    envline KUBE_TOKEN "$ADMIN_TOKEN"
    envline KUBE_CA "$DIR/pki/ca.crt"
    envline KUBECONFIG "$DIR/kubeconfig"
    envline KUBECTL "$BIN/kubectl"
    envline KUBE_BIN_DIR "$BIN"
    envline ETCD_ENDPOINT "http://127.0.0.1:$ETCD_PORT"
    envline KUBE_CLUSTER_DIR "$DIR"
  } >"$DIR/env.tmp"
  mv "$DIR/env.tmp" "$DIR/env"

  # The controller-manager creates the default ServiceAccount and publishes the CA.
  ok=
  for i in $(seq 1 600); do  # 30 s
    if [ "$(api /api/v1/namespaces/default/serviceaccounts/default)" = 200 ] &&
       [ "$(api /api/v1/namespaces/default/configmaps/kube-root-ca.crt)" = 200 ]; then ok=1; break; fi
    for n in kube-controller-manager kube-scheduler; do
      # kill -0, not pid_is: right after launch the pid may still be the
      # subshell that is about to exec the daemon (its cmdline says bash).
      kill -0 "$(awk -v n=$n '$1==n{print $2}' "$DIR/pids")" 2>/dev/null || fail_start "$n exited"
    done
    sleep 0.05
  done
  [ -n "$ok" ] || fail_start "no default ServiceAccount / kube-root-ca.crt after 30 s"
  log "started in $(elapsed "$t0") s (apiserver ready at ${t_api} s): KUBE_SERVER=https://127.0.0.1:$API_PORT env=$DIR/env"
}

case "$CMD" in
  start) start_cluster ;;
  stop)
    if [ -d "$DIR" ]; then stop_cluster; fi ;;
  *) usage ;;
esac

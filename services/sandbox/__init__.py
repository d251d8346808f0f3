"""rlyard sandbox-executor: isolated Linux environments behind gRPC and an E2B-compatible HTTP API.

Modules, in the order a request meets them:
  __main__    CLI: serve, or `template build|import|list|remove`
  grpc_api    the rlyard.v1.Sandbox servicer
  http_api    E2B control plane (/sandboxes, /v2/sandboxes, ...) and GET /health
  envd_api    envd data plane (Connect process/filesystem RPCs, /files)
  manager     lifecycle state machine, warm pool, TTL, snapshot/fork, restart recovery
  spawner     the service's handle on the zygote
  zygote      forks each sandbox's init: namespaces, overlay root, /proc, /dev, pivot_root, capabilities
  init        PID 1 inside a sandbox: runs commands and file operations sent over its control socket
  channel     async client of that control socket; wire: its framing
  cgroups     cgroup v1 memory/pids/cpu/freezer; storage: on-disk layout, layers, snapshots
  egress      policy-checked HTTP(S) proxy per sandbox; egress_relay: its in-sandbox TCP relay
  backends    namespace / userns / process choice; templates: debootstrap, import, list
  linux       ctypes wrappers (unshare, mount, pivot_root, prctl, capset)
"""

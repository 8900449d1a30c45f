//go:build tools

// Package tools names the commands scripts/install-kube.sh builds, so that `go mod tidy` keeps
// their dependencies pinned in go.mod and go.sum.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)

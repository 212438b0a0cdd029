// Command k8s-testenv is etcd, kube-apiserver and kube-scheduler in one
// binary, built from their published Go modules for gpuvisor's cluster tests
// (see docs/kubernetes.md, "How the cluster half is tested").  It is a
// multi-call binary: run it through a link named etcd, kube-apiserver or
// kube-scheduler, or give the component as its first argument.  Each
// component runs its upstream main unchanged.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata" // as kube-apiserver's own main: time zones for CronJobs

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

const usage = "usage: k8s-testenv etcd|kube-apiserver|kube-scheduler [flags]"

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args
	if name != "etcd" && name != "kube-apiserver" && name != "kube-scheduler" {
		if len(os.Args) < 2 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		name = os.Args[1]
		args = append([]string{name}, os.Args[2:]...)
	}
	// Each runs as its upstream main does (some read os.Args themselves).
	os.Args = args
	switch name {
	case "etcd":
		etcdmain.Main(args)
	case "kube-apiserver":
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	case "kube-scheduler":
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	default:
		fmt.Fprintf(os.Stderr, "k8s-testenv: unknown component %q\n%s\n", name, usage)
		os.Exit(2)
	}
}

//! The Kubernetes manifests under deploy/k8s are valid against the
//! Kubernetes API's schemas (`kubernetes-validate --strict`, from PyPI, in
//! the tests' Python): every resource of the base and of the autoscaling
//! overlay, unknown fields refused. The ServiceMonitor is the Prometheus
//! Operator's custom resource, which the validator has no schema for:
//! its absence is the only warning allowed.

use std::process::Command;

#[test]
fn the_kubernetes_manifests_are_valid_against_the_api_schemas() {
    let python = match flotilla_hub::test_python() {
        Ok(p) => p,
        Err(e) => panic!("the manifest check cannot run: {e}"),
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/k8s");
    let files = [
        "namespace.yaml",
        "config.yaml",
        "router.yaml",
        "workers.yaml",
        "autoscaling/config.yaml",
        "autoscaling/hpa.yaml",
        "autoscaling/servicemonitor.yaml",
    ];
    let mut resources = 0;
    for f in files {
        let path = root.join(f);
        let out = Command::new(&python)
            .args(["-m", "kubernetes_validate", "--strict"])
            .arg(&path)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{f}: {text}");
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if line.starts_with("INFO") && line.contains(" passed for resource ") {
                resources += 1;
            } else {
                assert!(
                    f.ends_with("servicemonitor.yaml")
                        && line.contains("Couldn't find schema for kind ServiceMonitor"),
                    "{f}: {line}"
                );
            }
        }
    }
    // namespace, 2 secrets, the routers' two Services + StatefulSet, the
    // workers' Service + StatefulSet, the HPA.
    assert_eq!(resources, 9);
}

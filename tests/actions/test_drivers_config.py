"""IsolationSettings and make_cluster_driver: which driver each setting gives, and clear errors
for a kubernetes configuration that cannot be loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierwatch.server.actions.drivers import (
    DriverConfigError,
    IsolationSettings,
    KubernetesDriver,
    SlurmDriver,
    make_cluster_driver,
)

KUBECONFIG = """\
apiVersion: v1
kind: Config
current-context: prod
clusters:
- name: prod
  cluster: {server: "https://10.0.0.1:6443", insecure-skip-tls-verify: true}
- name: lab
  cluster: {server: "http://127.0.0.1:18080"}
users:
- name: tierwatch
  user: {token: not-a-real-token}
contexts:
- name: prod
  context: {cluster: prod, user: tierwatch}
- name: lab
  context: {cluster: lab, user: tierwatch}
"""


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    return path


@pytest.mark.parametrize("name", ["none", "command"])
def test_no_server_side_driver(name: str) -> None:
    assert make_cluster_driver(IsolationSettings(driver=name)) is None  # type: ignore[arg-type]


def test_default_is_none() -> None:
    settings = IsolationSettings()
    assert settings.driver == "none"
    assert make_cluster_driver(settings) is None


def test_slurm() -> None:
    driver = make_cluster_driver(IsolationSettings(driver="slurm", scontrol="/usr/bin/scontrol"))
    assert isinstance(driver, SlurmDriver)
    assert driver.name == "slurm"


def test_kubernetes_from_kubeconfig(kubeconfig: Path) -> None:
    driver = make_cluster_driver(IsolationSettings(driver="kubernetes", kubeconfig=str(kubeconfig)))
    assert isinstance(driver, KubernetesDriver)
    try:
        assert driver.name == "kubernetes"
        assert driver.host == "https://10.0.0.1:6443"
    finally:
        driver.close()


def test_kubernetes_context(kubeconfig: Path) -> None:
    driver = make_cluster_driver(
        IsolationSettings(driver="kubernetes", kubeconfig=str(kubeconfig), kube_context="lab")
    )
    assert isinstance(driver, KubernetesDriver)
    try:
        assert driver.host == "http://127.0.0.1:18080"
    finally:
        driver.close()


def test_kubeconfig_is_not_rewritten(kubeconfig: Path) -> None:
    driver = make_cluster_driver(IsolationSettings(driver="kubernetes", kubeconfig=str(kubeconfig)))
    assert isinstance(driver, KubernetesDriver)
    driver.close()
    assert kubeconfig.read_text() == KUBECONFIG


def test_missing_kubeconfig(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "kubeconfig"
    with pytest.raises(DriverConfigError) as caught:
        make_cluster_driver(IsolationSettings(driver="kubernetes", kubeconfig=str(missing)))
    assert str(caught.value) == (
        f"TIERWATCH_ISOLATION__KUBECONFIG={missing}: no such file; "
        "set it to a readable kubeconfig file"
    )
    assert isinstance(caught.value, ValueError)


def test_kubeconfig_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(DriverConfigError, match="no such file"):
        make_cluster_driver(IsolationSettings(driver="kubernetes", kubeconfig=str(tmp_path)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: [", "invalid kubeconfig: while parsing"),
        ("", "file is empty"),
        ("apiVersion: v1\nkind: Config\nclusters: []\n", "current-context"),
    ],
)
def test_invalid_kubeconfig(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(DriverConfigError, match=expected) as caught:
        make_cluster_driver(IsolationSettings(driver="kubernetes", kubeconfig=str(path)))
    assert str(caught.value).startswith(f"TIERWATCH_ISOLATION__KUBECONFIG={path}: ")


def test_unknown_context(kubeconfig: Path) -> None:
    with pytest.raises(DriverConfigError, match=r"KUBE_CONTEXT=staging\): invalid kubeconfig"):
        make_cluster_driver(
            IsolationSettings(
                driver="kubernetes", kubeconfig=str(kubeconfig), kube_context="staging"
            )
        )


def test_in_cluster_config_outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(DriverConfigError) as caught:
        make_cluster_driver(IsolationSettings(driver="kubernetes"))
    message = str(caught.value)
    assert "in-cluster service account, which is not available here" in message
    assert "set TIERWATCH_ISOLATION__KUBECONFIG to a kubeconfig file" in message


def test_context_without_kubeconfig() -> None:
    with pytest.raises(DriverConfigError, match="KUBE_CONTEXT is set without"):
        make_cluster_driver(IsolationSettings(driver="kubernetes", kube_context="lab"))


def test_settings_validation() -> None:
    with pytest.raises(ValidationError):
        IsolationSettings(timeout_s=0)
    with pytest.raises(ValidationError):
        IsolationSettings(driver="pbs")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="not a Kubernetes taint key"):
        IsolationSettings(taint_key="bad key!")
    with pytest.raises(
        ValidationError, match="not a Kubernetes annotation key.*tierwatch.io/isolation"
    ):
        IsolationSettings(annotation_key="tierwatch.io/")
    with pytest.raises(ValidationError):
        IsolationSettings(scontrol="")
    assert IsolationSettings(kubeconfig="", kube_context="").kubeconfig is None
    assert IsolationSettings(taint_key="isolated").taint_key == "isolated"


def test_nested_env_names(monkeypatch: pytest.MonkeyPatch, kubeconfig: Path) -> None:
    # The server nests these as Settings.isolation (env prefix TIERWATCH_, delimiter "__").
    class Nesting(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="TIERWATCH_", env_nested_delimiter="__")
        isolation: IsolationSettings = IsolationSettings()

    monkeypatch.setenv("TIERWATCH_ISOLATION__DRIVER", "kubernetes")
    monkeypatch.setenv("TIERWATCH_ISOLATION__TIMEOUT_S", "12.5")
    monkeypatch.setenv("TIERWATCH_ISOLATION__SCONTROL", "/opt/slurm/bin/scontrol")
    monkeypatch.setenv("TIERWATCH_ISOLATION__KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("TIERWATCH_ISOLATION__KUBE_CONTEXT", "lab")
    monkeypatch.setenv("TIERWATCH_ISOLATION__TAINT_KEY", "example.com/isolated")
    assert Nesting().isolation == IsolationSettings(
        driver="kubernetes",
        timeout_s=12.5,
        scontrol="/opt/slurm/bin/scontrol",
        kubeconfig=str(kubeconfig),
        kube_context="lab",
        taint_key="example.com/isolated",
    )

"""Each charging pass alone on a tiny hand-built graph (no ONNX, no ORT).

The hand-built backward graph mirrors what ORT emits for::

    x -> Conv(k0, b1) -> BN(g2, be3) -> Relu -> Gemm(k4, b5) -> loss

Tensors (forward order): 0 conv kernel, 1 conv bias, 2 bn gamma, 3 bn beta, 4 fc kernel, 5 fc bias.
"""

from __future__ import annotations

import networkx as nx
import pytest

from passes import (
    DEFAULT_RULE,
    BatchNormPass,
    ConvDensePass,
    LinearizePass,
    NonTrainablePass,
    PassManager,
    PassResult,
    op_id,
    op_rule,
    set_charge,
    tensor_id,
)

TENSORS = [
    ("k0", "kernel", "conv"),
    ("b1", "bias", "conv"),
    ("g2", "gamma", "bn"),
    ("be3", "beta", "bn"),
    ("k4", "kernel", "fc"),
    ("b5", "bias", "fc"),
]


def add_tensors(g: nx.DiGraph, tensors=TENSORS) -> None:
    for i, (name, kind, layer) in enumerate(tensors):
        g.add_node(
            tensor_id(name),
            node_type="tensor",
            index=i,
            name=name,
            kind=kind,
            layer=layer,
            values=[name],
        )


def add_op(g, name, op_type, role="backward", inputs=(), outputs=(), **attrs):
    g.add_node(
        op_id(name),
        node_type="op",
        name=name,
        op_type=op_type,
        role=role,
        inputs=list(inputs),
        outputs=list(outputs),
        charge=None,
        **attrs,
    )


def data(g, src, dst, value):
    g.add_edge(op_id(src), op_id(dst), kind="data", values=[value])


def grad(g, src, tensor):
    g.add_edge(op_id(src), tensor_id(tensor), kind="grad", values=[f"{tensor}_grad"])


def chain_graph() -> nx.DiGraph:
    """The backward graph of the docstring's model, before any pass."""
    g = nx.DiGraph()
    add_tensors(g)
    add_op(g, "conv", "Conv", "forward", ["x", "k0", "b1"], ["c"])
    add_op(g, "loss", "SoftmaxCrossEntropyLoss", "loss", ["y", "labels"], ["l", "logp"])
    add_op(g, "loss_grad", "SoftmaxCrossEntropyLossGrad", inputs=["logp"], outputs=["y_grad"])
    add_op(g, "fc_db", "ReduceSum", inputs=["y_grad"], outputs=["b5_grad"])
    add_op(g, "fc_dw", "Gemm", inputs=["y_grad", "h"], outputs=["k4_grad"])
    add_op(g, "fc_dx", "Gemm", inputs=["y_grad", "k4"], outputs=["h_grad"])
    add_op(g, "relu_grad", "ReluGrad", inputs=["h_grad", "h"], outputs=["n_grad"])
    add_op(g, "bn_grad", "BatchNormalizationGrad", inputs=["n_grad"],
           outputs=["c_grad", "g2_grad", "be3_grad"])  # fmt: skip
    add_op(
        g, "conv_grad", "ConvGrad", inputs=["c_grad", "x", "k0"], outputs=["", "k0_grad", "b1_grad"]
    )
    add_op(g, "acc_k4", "InPlaceAccumulatorV2", "accumulate", ["buf", "k4_grad", "reset"], ["o"])
    data(g, "loss", "loss_grad", "logp")
    for dst in ("fc_db", "fc_dw", "fc_dx"):
        data(g, "loss_grad", dst, "y_grad")
    grad(g, "fc_db", "b5")
    grad(g, "fc_dw", "k4")
    data(g, "fc_dw", "acc_k4", "k4_grad")
    data(g, "fc_dx", "relu_grad", "h_grad")
    data(g, "relu_grad", "bn_grad", "n_grad")
    grad(g, "bn_grad", "g2")
    grad(g, "bn_grad", "be3")
    data(g, "bn_grad", "conv_grad", "c_grad")
    grad(g, "conv_grad", "k0")
    grad(g, "conv_grad", "b1")
    return g


def set_d(g, op, members, outputs_max=None):
    """Hand-set what LinearizePass would compute, so a charging pass can be tested alone."""
    a = g.nodes[op_id(op)]
    a.update(
        d_size=len(members),
        d_min=min(members) if members else None,
        d_max=max(members) if members else None,
        d_out_max=outputs_max if outputs_max is not None else [max(members) if members else None],
    )


def with_order(g):
    g.graph["tensor_order"] = [name for name, _, _ in TENSORS]
    return g


# ---- linearize ----


def test_linearize_order_chain_and_d_sets():
    g = chain_graph()
    result = LinearizePass()(g)
    assert result.modified
    assert g.graph["tensor_order"] == ["k0", "b1", "g2", "be3", "k4", "b5"]
    assert (
        g.has_edge(tensor_id("b5"), tensor_id("k4"))
        and g.edges[tensor_id("b5"), tensor_id("k4")]["kind"] == "chain"
    )
    assert not g.has_edge(tensor_id("k0"), tensor_id("b1"))
    n = g.nodes
    assert (n[op_id("loss_grad")]["d_size"], n[op_id("loss_grad")]["d_max"]) == (6, 5)
    assert (n[op_id("fc_dw")]["d_size"], n[op_id("fc_dw")]["d_max"]) == (1, 4)
    assert (
        n[op_id("fc_dx")]["d_min"],
        n[op_id("fc_dx")]["d_max"],
        n[op_id("fc_dx")]["d_size"],
    ) == (0, 3, 4)
    assert n[op_id("bn_grad")]["d_out_max"] == [1, 2, 3]
    assert n[op_id("conv_grad")]["d_out_max"] == [None, 0, 1]
    assert n[op_id("acc_k4")]["d_size"] == 0  # downstream of the gradient, serves nothing
    assert "d_size" not in n[op_id("conv")]  # forward ops are not analysed


def test_linearize_branch_union():
    """An op whose output feeds two branches depends on the union of both branches' tensors."""
    g = nx.DiGraph()
    add_tensors(g, [("a", "kernel", "l0"), ("b", "kernel", "l1"), ("c", "kernel", "l2")])
    add_op(g, "split", "Identity", outputs=["s"])
    add_op(g, "left", "Gemm", outputs=["a_grad"])
    add_op(g, "right", "Gemm", outputs=["c_grad"])
    data(g, "split", "left", "s")
    data(g, "split", "right", "s")
    grad(g, "left", "a")
    grad(g, "right", "c")
    LinearizePass()(g)
    a = g.nodes[op_id("split")]
    assert (a["d_min"], a["d_max"], a["d_size"]) == (0, 2, 2)  # {a, c}: a gap at b


def test_linearize_rejects_bad_indices():
    g = nx.DiGraph()
    add_tensors(g, [("a", "kernel", "l0")])
    g.nodes[tensor_id("a")]["index"] = 3
    with pytest.raises(ValueError, match="0..N-1"):
        LinearizePass()(g)


# ---- conv_dense ----


def test_conv_dense_alone():
    g = with_order(chain_graph())
    set_d(g, "conv_grad", [0, 1], [None, 0, 1])
    set_d(g, "fc_dw", [4])
    set_d(g, "fc_db", [5])
    set_d(g, "fc_dx", [0, 1, 2, 3])
    set_d(g, "relu_grad", [0, 1, 2, 3])
    set_d(g, "bn_grad", [0, 1, 2, 3], [1, 2, 3])
    set_d(g, "loss_grad", list(range(6)))
    assert ConvDensePass()(g).modified
    n = g.nodes
    conv = n[op_id("conv_grad")]
    assert conv["charge"] == "split" and conv["charge_dy_tensor"] is None
    assert conv["charge_dw_tensors"] == ["k0", "b1"]
    assert (n[op_id("fc_dw")]["charge"], n[op_id("fc_dw")]["charge_tensor"]) == ("dw", "k4")
    assert (n[op_id("fc_db")]["charge"], n[op_id("fc_db")]["charge_tensor"]) == ("dw", "b5")
    # the input-gradient op reads the kernel: t_dy of the closest earlier tensor (the BN beta)
    assert (n[op_id("fc_dx")]["charge"], n[op_id("fc_dx")]["charge_tensor"]) == ("dy", "be3")
    assert n[op_id("fc_dx")]["rule"] == "conv_dense"
    for other in ("relu_grad", "bn_grad", "loss_grad", "conv", "loss", "acc_k4"):
        assert n[op_id(other)]["charge"] is None
    assert g.edges[op_id("fc_dx"), tensor_id("be3")]["charge"] == "dy"
    assert g.edges[op_id("fc_dw"), tensor_id("k4")] == {
        "kind": "grad",
        "values": ["k4_grad"],
        "charge": "dw",
    }


def test_conv_dense_split_with_input_gradient_depthwise():
    """A later (e.g. depthwise) ConvGrad with a dX output charges dX to the earlier tensor."""
    g = nx.DiGraph()
    add_tensors(g, [("k0", "kernel", "c0"), ("k1", "kernel", "dw1")])
    g.graph["tensor_order"] = ["k0", "k1"]
    add_op(g, "dw_grad", "ConvGrad", outputs=["x_grad", "k1_grad"])
    set_d(g, "dw_grad", [0, 1], [0, 1])
    ConvDensePass()(g)
    a = g.nodes[op_id("dw_grad")]
    assert (a["charge"], a["charge_dy_tensor"], a["charge_dw_tensors"]) == ("split", "k0", ["k1"])


def test_conv_dense_leaves_charged_ops():
    g = with_order(chain_graph())
    set_d(g, "fc_dw", [4])
    set_charge(g, op_id("fc_dw"), "dy", "test", "b5")
    assert not ConvDensePass()(g).modified
    assert g.nodes[op_id("fc_dw")]["charge"] == "dy"


# ---- batch_norm ----


def test_batch_norm_alone():
    g = with_order(chain_graph())
    set_d(g, "bn_grad", [0, 1, 2, 3], [1, 2, 3])
    add_op(g, "gamma_helper", "Identity", inputs=["t"], outputs=["g2_grad_part"])
    set_d(g, "gamma_helper", [2])
    set_d(g, "fc_dw", [4])
    assert BatchNormPass()(g).modified
    n = g.nodes
    assert (n[op_id("bn_grad")]["charge"], n[op_id("bn_grad")]["charge_tensor"]) == ("dy", "be3")
    assert (n[op_id("gamma_helper")]["charge"], n[op_id("gamma_helper")]["charge_tensor"]) == (
        "dy",
        "be3",
    )
    assert n[op_id("fc_dw")]["charge"] is None  # not a norm tensor


def test_batch_norm_without_beta_uses_gamma():
    g = nx.DiGraph()
    add_tensors(g, [("k0", "kernel", "c"), ("g1", "gamma", "rms")])
    g.graph["tensor_order"] = ["k0", "g1"]
    add_op(g, "ln_grad", "SimplifiedLayerNormalizationGrad", outputs=["x_grad", "g1_grad"])
    set_d(g, "ln_grad", [0, 1], [0, 1])
    BatchNormPass()(g)
    assert g.nodes[op_id("ln_grad")]["charge_tensor"] == "g1"


# ---- non_trainable ----


def test_non_trainable_alone():
    g = with_order(chain_graph())
    set_d(g, "loss_grad", list(range(6)))
    set_d(g, "relu_grad", [0, 1, 2, 3])
    set_d(g, "fc_db", [5])
    for op in ("fc_dw", "fc_dx", "bn_grad", "conv_grad", "acc_k4"):
        set_d(g, op, [])
    add_op(g, "dead", "Shape", inputs=["h"], outputs=["unused"])
    set_d(g, "dead", [])
    assert NonTrainablePass()(g).modified
    n = g.nodes
    expect = {
        "conv": ("forward", None),
        "loss": ("loss", None),
        "loss_grad": ("dy", "b5"),
        "relu_grad": ("dy", "be3"),
        "fc_db": ("dw", "b5"),
        "acc_k4": ("dw", "k4"),
        "dead": ("dy", "b5"),
    }
    for op, (kind, tensor) in expect.items():
        assert (n[op_id(op)]["charge"], n[op_id(op)]["charge_tensor"]) == (kind, tensor), op
    assert all(a.get("charge") for _, a in g.nodes(data=True) if a["node_type"] == "op")


# ---- manager and registry ----


def test_pass_manager_full_pipeline_on_hand_built_graph():
    g = chain_graph()
    result = PassManager(
        [LinearizePass(), ConvDensePass(), BatchNormPass(), NonTrainablePass()]
    ).run(g)
    assert result.modified
    n = g.nodes
    assert n[op_id("bn_grad")]["rule"] == "batch_norm"
    assert n[op_id("relu_grad")]["rule"] == "non_trainable"
    assert n[op_id("conv_grad")]["rule"] == "conv_dense"
    assert n[op_id("acc_k4")]["charge_tensor"] == "k4"


def test_pass_manager_reports_unmodified():
    class Noop:
        name = "noop"

        def __call__(self, graph):
            return PassResult(graph, False)

    g = nx.DiGraph()
    assert not PassManager([Noop(), Noop()]).run(g).modified


def test_registry_is_keyed_by_op_type():
    assert op_rule("Conv").weight_slots == {1: "kernel", 2: "bias"}
    assert op_rule("BatchNormalization").stat_slots == (3, 4)
    assert op_rule("ConvGrad").fused_grad[0] == "dx"
    assert op_rule("LayerNormalizationGrad").norm_grad
    assert not op_rule("Shape").differentiable
    assert op_rule("SomeCustomOp") is DEFAULT_RULE

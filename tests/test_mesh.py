import pytest

from megajax.core.mesh import make_mesh, parse_mesh_spec


@pytest.mark.parametrize("spec,expected", [
    ("data=2,model=4", (2, 4)), ("2x4", (2, 4)), ("model=8", (1, 8)), ("model=2", (4, 2)),
    ("data=8", (8, 1)), ("auto", (8, 1)), ("", (8, 1)), (" Data=4, Model=2 ", (4, 2)), ("1x8", (1, 8)),
])
def test_parse(spec, expected):
    assert parse_mesh_spec(spec, 8) == expected


def test_make_mesh_axes(devices):
    mesh = make_mesh("2x4")
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.parametrize("spec,message", [
    ("2x2", "needs 4 devices"), ("data=3", "does not divide"), ("model=0", "must be positive"),
    ("model=-2", "must be positive"), ("pipe=2", "unknown axis 'pipe'"), ("2x2x2", "DATAxMODEL"),
    ("model=two", "must be an integer"), ("data=2,data=4", "given twice"),
])
def test_bad_specs_name_the_devices(devices, spec, message):
    with pytest.raises(ValueError) as e:
        make_mesh(spec)
    assert message in str(e.value)
    assert "8 cpu devices available" in str(e.value)

"""What dockerd appends as NVIDIA_VISIBLE_DEVICES for a container's DeviceRequests (moby
daemon/nvidia_linux.go), as gpuhook.request.dockerd reads it from hostconfig.json."""

import pytest

from gpuhook.request import dockerd

GPU = [["gpu"]]  # what `docker run --gpus` asks for


@pytest.mark.parametrize("requests,value", [
    ([{"Driver": "", "Count": -1, "DeviceIDs": None, "Capabilities": GPU}], "all"),         # --gpus all
    ([{"Driver": "", "Count": 2, "DeviceIDs": None, "Capabilities": GPU}], "0,1"),          # --gpus 2
    ([{"Driver": "", "Count": 0, "DeviceIDs": ["1", "3"], "Capabilities": GPU}], "1,3"),    # device=1,3
    ([{"Driver": "", "Count": 0, "DeviceIDs": ["GPU-a"], "Capabilities": GPU}], "GPU-a"),
    ([{"Driver": "", "Count": 0, "DeviceIDs": None, "Capabilities": GPU}], None),           # --gpus 0
    ([{"Driver": "nvidia", "Count": -1, "Capabilities": None}], "all"),                    # the driver by name
    ([{"Driver": "other", "Count": -1, "Capabilities": GPU}], None),                       # another driver's
    ([{"Driver": "", "Count": -1, "Capabilities": [["gpu", "fpga"]]}], None),              # caps nvidia lacks
    ([{"Driver": "", "Count": -1, "Capabilities": [["fpga"], ["compute", "utility"]]}], "all"),  # OR of ANDs
    ([{"Count": 1, "Capabilities": GPU}, {"DeviceIDs": ["3"], "Capabilities": GPU}], "3"),  # the last wins
    ([], None), (None, None),
])
def test_the_value_dockerd_appends_for_each_gpus_form(requests, value):
    assert dockerd.appended_value(requests) == value

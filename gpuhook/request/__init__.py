"""What a container asks for, read from the runtime's input: the OCI state and config.json
(oci), the request they carry (resolve), the image's NVIDIA_REQUIRE_* (requirements).
Pure: reads the parsed input only."""

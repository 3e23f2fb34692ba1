/*
 * A stand-in for one NVIDIA driver library, built by `gpuhook simulate`.
 *
 * It is a real ELF shared object with the driver's soname and versioned file name, so the
 * host's ldconfig indexes it and a container's dynamic linker can load it; it does nothing
 * else. SIM_LIBRARY and SIM_DRIVER_VERSION are set on the compiler command line.
 */
const char gpuhook_sim_library[] = SIM_LIBRARY;

const char *gpuhook_sim_driver_version(void)
{
    return SIM_DRIVER_VERSION;
}

# toml++ as LOCKSTEP_TOMLPP: its CMake package where the distribution ships one, else pkg-config
# (some packagings ship only the .pc file). Included by the project and by the
# standalone fuzz project (tests/fuzz).
find_package(tomlplusplus CONFIG QUIET)
if(TARGET tomlplusplus::tomlplusplus)
  set(LOCKSTEP_TOMLPP tomlplusplus::tomlplusplus)
else()
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(TOMLPP REQUIRED IMPORTED_TARGET tomlplusplus)
  set(LOCKSTEP_TOMLPP PkgConfig::TOMLPP)
endif()

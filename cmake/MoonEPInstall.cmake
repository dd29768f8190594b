# Installation: header, libmoonep.so (SONAME = major version), MoonEPConfig.cmake and moonep.pc.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
install(TARGETS moonep EXPORT MoonEPTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Every public header (moonep.h and the headers it includes, e.g. moonep_runtime.h).
file(GLOB MOONEP_PUBLIC_HEADERS ${PROJECT_SOURCE_DIR}/moonep/include/moonep/*.h)
install(FILES ${MOONEP_PUBLIC_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moonep)
install(EXPORT MoonEPTargets NAMESPACE MoonEP:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoonEP)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/MoonEPConfig.cmake.in
  ${PROJECT_BINARY_DIR}/MoonEPConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoonEP)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/MoonEPConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/MoonEPConfig.cmake ${PROJECT_BINARY_DIR}/MoonEPConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoonEP)
configure_file(${PROJECT_SOURCE_DIR}/cmake/moonep.pc.in ${PROJECT_BINARY_DIR}/moonep.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/moonep.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

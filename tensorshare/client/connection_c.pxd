# The compiled twin connection_c is typed by connection.pxd (the declarations other twins cimport).
include "connection.pxd"

# Prints the test files of one of SQLite's permutations.test suites, one a
# line, sorted (as permutations.test gives them: a bare name for files in
# test/, a path for files under ext/).
#
# Usage (in a scratch directory: tester.tcl creates test.db there):
#   testfixture list_suite.tcl SQLITE_SRC/test SUITE
if {[llength $argv] != 2} {
  puts stderr "usage: testfixture list_suite.tcl TESTDIR SUITE"
  exit 2
}
set testdir [file normalize [lindex $argv 0]]
set suite [lindex $argv 1]
# Any name but permutations.test: sourcing it then only defines the suites.
set argv0 [file join $testdir list_suite]
set argv {}
source [file join $testdir permutations.test]
if {![info exists ::testspec($suite)]} {
  puts stderr "no such suite: $suite"
  exit 2
}
array set O $::testspec($suite)
foreach f [lsort $O(-files)] {
  puts $f
}
exit 0

// Helpers shared by the scheduler tests. Header-only, torch-free (the tests
// run under the sanitizers).
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace torch_stage::schedule::testing {

// Expects `fn` to throw std::invalid_argument whose message contains `part`.
template <typename Fn>
void expect_invalid(Fn fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning: " << part;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

} // namespace torch_stage::schedule::testing

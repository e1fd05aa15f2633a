// Amounts past 2^31 minor units through the Java client that openapi-generator (java,
// library native) makes from openapi-3.0.json: a sale of 3,000,000,000 on the game
// big-keno (cap 6,000,000,000), the draw's exposure (a top-rank liability of 6 x 10^14), its
// combination and its cancel, each read back exactly. Run by
// tests/contract/test_other_languages.py: java LargeAmounts BASE_URL TOKEN TICKET_PREFIX
import capsvc.gen.ApiClient;
import capsvc.gen.api.AvailabilityApi;
import capsvc.gen.api.DrawsApi;
import capsvc.gen.api.TicketsApi;
import capsvc.gen.model.CancelOut;
import capsvc.gen.model.CombinationOut;
import capsvc.gen.model.ExposureOut;
import capsvc.gen.model.GridIn;
import capsvc.gen.model.TicketIn;
import capsvc.gen.model.TicketOut;
import java.util.List;

public class LargeAmounts {
  static final String GAME = "big-keno";
  static final List<Integer> TEN = List.of(3, 7, 12, 18, 25, 33, 41, 56, 60, 70);
  static final long STAKE = 3_000_000_000L;
  static final long CAP = 6_000_000_000L;
  // staked / prize_base_stake (100) x the preset's top prize for 10 numbers (20,000,000)
  static final long LIABILITY = STAKE / 100 * 20_000_000L;

  static void check(boolean ok, String what) {
    if (!ok) {
      throw new AssertionError(what);
    }
    System.out.println("ok " + what);
  }

  public static void main(String[] args) throws Exception {
    String token = args[1];
    String id = args[2] + "-1";
    ApiClient client = new ApiClient();
    client.updateBaseUri(args[0]);
    client.setRequestInterceptor(b -> b.header("Authorization", "Bearer " + token));
    TicketsApi tickets = new TicketsApi(client);
    DrawsApi draws = new DrawsApi(client);
    // The draw after the one on sale: the exposure of the draw on sale is also computed for
    // the metrics, and a computation is served again for a few seconds (one made just
    // before the sale would not show it).
    int draw = draws.getCurrentDraw(GAME).getDraw() + 1;

    TicketOut sold = tickets.sellTicket(new TicketIn().ticketId(id).game(GAME).firstDraw(draw)
        .addGridsItem(new GridIn().numbers(TEN).stake(STAKE)));
    check(sold.getStatus() == TicketOut.StatusEnum.ACCEPTED, "sold");
    check(sold.getTotalCost() == STAKE, "total_cost " + sold.getTotalCost());
    check(sold.getGrids().get(0).getCost() == STAKE, "grid cost " + sold.getGrids().get(0).getCost());

    ExposureOut exposure = draws.getExposure(GAME, draw);
    check(exposure.getCap() == CAP, "cap " + exposure.getCap());
    check(exposure.getTop().get(0).getStaked() == STAKE,
        "top staked " + exposure.getTop().get(0).getStaked());
    check(exposure.getTop().get(0).getLiability() == LIABILITY,
        "liability " + exposure.getTop().get(0).getLiability());
    check(exposure.getTopLiability() == LIABILITY, "top_liability " + exposure.getTopLiability());

    CombinationOut combination = new AvailabilityApi(client).getCombination(
        GAME, draw, "3-7-12-18-25-33-41-56-60-70");
    check(combination.getStaked() == STAKE && combination.getRemaining() == CAP - STAKE,
        "combination staked " + combination.getStaked() + ", remaining "
        + combination.getRemaining());

    CancelOut cancelled = tickets.cancelTicket(id);
    check(cancelled.getReleased() == STAKE, "released " + cancelled.getReleased());
  }
}

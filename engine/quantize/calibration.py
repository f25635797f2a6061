"""Calibration text for activation-aware INT4 (`kvpilot quantize --method awq`).

Source: written for kvpilot (no third-party text), in the genres a small instruct model serves:
narrative, explanation, instructions, dialogue, correspondence, news, and a little code. It is kept
apart from what `kvpilot eval` scores: no CPython documentation (the perplexity text) and no
country capitals (the task set); tests/engine/quantize/test_awq.py checks that they share no phrase.
"""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    """The lighthouse keeper had not seen a ship in eleven days. Every evening she climbed the
ninety-one steps, trimmed the wick, polished the great lens with a soft cloth and wrote a single
line in the logbook: weather, wind, nothing to report. On the twelfth morning a small boat with a
torn red sail drifted into the cove. A boy of about ten sat in it, holding an oar that was far too
large for him, and asked politely whether this was the island with the library. She told him there
was no library, only a lighthouse, a goat and a great many books that nobody had ever read. He
said that would do nicely, and climbed out onto the rocks as if he had been expected.""",
    """Why does bread rise? Yeast is a living fungus that feeds on the sugars released when flour
is mixed with water. As it eats, it produces carbon dioxide and a little alcohol. The gas forms
bubbles, and the gluten, a stretchy network of proteins built up by kneading, traps those bubbles
so that the dough swells instead of letting the gas escape. Warmth speeds the yeast up and cold
slows it down, which is why bakers leave dough somewhere cozy to prove, or in the refrigerator
overnight when they want a slower rise and a deeper flavour. In the oven the heat makes the
bubbles expand one last time before the yeast dies and the crumb sets around them.""",
    """To replace a bicycle inner tube, first shift to the smallest rear sprocket and open the
brake so the wheel can pass. Release the quick-release lever or loosen the axle nuts and take the
wheel out. Let any remaining air out of the valve, then push the tyre bead toward the centre of the
rim all the way round; this gives you slack. Hook a tyre lever under the bead opposite the valve,
lever it over the rim, and run a second lever around until one side is free. Pull out the old
tube, and run your fingers carefully around the inside of the tyre to find whatever caused the
puncture. Put a little air in the new tube so it holds its shape, tuck it in starting at the valve,
and roll the bead back on with your thumbs.""",
    """User: Can you help me plan a three-day trip to the mountains in early autumn?
Assistant: Of course. On the first day, arrive by midday, check in, and take a short walk along the
lake to get used to the altitude. On the second day, start early with the ridge trail: it takes
about six hours, the views are best before noon, and the huts on the way sell soup and tea. Pack
a warm layer, because the weather can turn quickly. On the third day, rest your legs with a visit
to the cheese dairy in the valley and the small museum of local crafts, then head home in the
afternoon.
User: What if it rains on the second day?
Assistant: Swap days two and three, and keep the ridge for when the forecast clears; the trail is
slippery and the views are gone in low cloud.""",
    """Dear Ms. Okafor,
Thank you for your letter of the fourth and for the samples of the new packaging. Our team tested
them over two weeks in the warehouse and in three of our shops. The boxes held up well to stacking
and to the damp in the loading bay, and customers found the handles easy to carry. Two concerns
came up: the printed instructions are small enough that some older customers struggled to read
them, and the tear strip on the side sometimes opens the box before it reaches the shelf. If these
can be addressed, we would like to place a first order of four thousand units in the spring.
With kind regards,
Daniel Ferreira, Purchasing""",
    """The town council voted on Tuesday evening to convert the old railway goods yard into a
public park with a playground, a community garden and a covered market for weekend traders. The
plan, which has been debated for almost six years, passed by seven votes to four after a meeting
that ran well past midnight. Supporters said the site had been an eyesore since the last freight
train left in the nineties, while opponents argued that the money would be better spent on
repairing roads and the swimming pool. Work is expected to begin next summer, once the soil has
been tested and cleaned, and the first section should open within two years.""",
    """def moving_average(values, window):
    \"\"\"Return the average of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages


print(moving_average([3, 5, 7, 9, 11], 2))  # [4.0, 6.0, 8.0, 10.0]""",
    """Octopuses are among the most intelligent invertebrates. Each has around five hundred million
neurons, most of them not in the brain but in the arms, which can taste, touch and make simple
decisions on their own. In the laboratory they have learned to open jars, to escape through
gaps barely wider than their eyes, and to recognise individual keepers, squirting water at the
ones they dislike. They change colour and texture in a fraction of a second using specialised
skin cells, which helps them hide from predators and surprise their prey. Most species live only
a year or two, and a mother guards her eggs without eating until they hatch.""",
    """Meeting notes, product team, Thursday.
1. The beta release slips by one week: the export feature still loses formatting on tables.
2. Priya will write the migration guide; Tom will review it before Monday.
3. Support tickets are down twelve percent since the new onboarding screens shipped.
4. We agreed to drop the dark theme from this release and revisit it next quarter.
5. Open question: should trial accounts keep their data for thirty days or ninety? Marketing
prefers ninety, engineering is worried about storage costs. Decision next week.
Action items: fix the table export, draft the guide, collect numbers on storage per account.""",
    """It was the kind of summer afternoon when nothing seems to move. The dog lay flat in the shade
of the porch, the washing hung perfectly still on the line, and somewhere down the lane a radio
was playing an old song about a train. Grandfather sat with his hat over his eyes and claimed he
was thinking. My sister and I had been told to stay quiet, so we were building a dam in the ditch
behind the barn, carrying mud in our hands and arguing in whispers about where the water should
go. By the time the storm came rolling over the hills we had a lake the size of a bathtub and two
very muddy pairs of shorts.""",
    """A budget works best when it is simple enough to keep. Start by writing down what comes in each
month after tax. Then list the fixed costs that do not change much: rent or mortgage, insurance,
transport passes, loan repayments. What is left has to cover food, clothes, going out and
everything else, and some of it should go to savings before you spend it, not after. Many people
find it helpful to move a fixed amount into a separate account on the day they are paid. Check
your spending once a week for the first couple of months; small repeated purchases, such as
coffee or subscriptions, are usually where the surprises hide.""",
    """#!/bin/sh
# Back up the photos folder to the external drive, keeping the last seven copies.
set -eu
src="$HOME/Pictures"
dest="/media/backup/photos"
stamp=$(date +%Y-%m-%d)
mkdir -p "$dest"
tar -czf "$dest/photos-$stamp.tar.gz" -C "$src" .
ls -1t "$dest"/photos-*.tar.gz | tail -n +8 | while read -r old; do
    rm -- "$old"
done
echo "backup written to $dest/photos-$stamp.tar.gz\"""",
    """Volcanic eruptions differ because magma differs. Runny magma that is low in silica lets gas
escape easily, so it pours out as glowing rivers of lava, as on many oceanic islands. Thick magma
rich in silica traps the gas until the pressure is enormous, and then the volcano explodes,
throwing ash and pumice kilometres into the sky. Scientists watch for small earthquakes, swelling
of the ground and changes in the gases leaking from vents, because magma rising toward the surface
usually announces itself weeks or months ahead. Forecasting the exact day of an eruption remains
very hard, but warnings have saved many lives.""",
    """User: My tomato plants have yellow leaves at the bottom. What am I doing wrong?
Assistant: Yellowing lower leaves are common and not always a problem. Older leaves near the soil
often fade as the plant puts its energy into new growth and fruit. If the yellowing spreads
upward, the usual causes are watering too much or too little, a lack of nitrogen, or a fungal
disease splashed up from the soil. Water deeply but less often, at the base rather than on the
leaves, add a layer of mulch to stop soil splashing, and feed with a balanced fertiliser. Remove
the affected leaves and throw them away rather than composting them.""",
    """The orchestra tuned up in a long, untidy chord, and then the hall fell silent. The conductor
raised her hands, held them still for a moment that seemed to last a minute, and brought them
down. The cellos began alone, low and slow, a melody that climbed a few notes and fell back as if
it had forgotten something. The violins answered, brighter and more hopeful, and for a while the
two groups passed the tune between them like a conversation between old friends who disagree.
When the brass finally entered, the whole building seemed to lean forward, and a child in the
front row forgot to close her mouth.""",
    """Good sleep habits are mostly about regularity. Go to bed and get up at roughly the same time
every day, including weekends, so your body clock can settle. Keep the bedroom cool, dark and
quiet, and use it for sleep rather than work. Bright screens late in the evening make it harder to
fall asleep, as do heavy meals, alcohol and caffeine after the early afternoon. Daylight in the
morning and some exercise during the day help. If you lie awake for more than twenty minutes, get
up, do something calm in dim light, and return to bed when you feel sleepy again.""",
    """SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS spent
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2025-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY spent DESC
LIMIT 10;
-- The ten customers who spent the most this year, among those with more than three orders.""",
    """In the spring of the year the river flooded the lower fields, as it did every few years, and
the farmers moved their animals to the hill pastures and waited. When the water went down it left
a layer of fine grey silt over everything, which smelled of mud and fish for a week and then
turned into the best soil in the valley. The old people said the river paid its rent that way.
The young ones, who had grown up with weather forecasts and insurance, were not so sure, but they
planted beans and barley in the silt all the same, and the harvest that autumn was the largest
anyone could remember.""",
    """Thank you for contacting customer support. I am sorry to hear that your order arrived
damaged. I have arranged for a replacement to be sent today by express delivery at no extra cost,
and you should receive it within two working days. There is no need to return the damaged item;
please recycle the packaging if you can. I have also added a discount code to your account that
you can use on your next purchase. If anything else goes wrong, just reply to this message and it
will come straight back to me. Have a good week.""",
    """A simple way to estimate the height of a tree is to use its shadow. On a sunny day, stand a
stick of known length upright and measure its shadow. Then measure the shadow of the tree at the
same moment. Because the sun's rays arrive almost parallel, the ratio of height to shadow is the
same for the stick and the tree. If a one-metre stick casts a shadow of eighty centimetres and
the tree's shadow is twelve metres long, the tree is twelve divided by zero point eight, or
fifteen metres tall. The ancient Greeks used the same idea to measure the pyramids.""",
)
